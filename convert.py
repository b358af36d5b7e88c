"""Conversions of a model's weights: MHA -> GQA/MQA by pooling K/V heads (the GQA paper's uptraining start, and its
ablations), and pretrained weights fitted to the run that fine-tunes them.
"""

from dataclasses import replace

from errors import UserError
from model import GPT


def for_finetuning(model: GPT, name: str, vocab_size: int, dropout: float, block_size: int,
                   n_kv_head: int | None) -> GPT:
    """Pretrained weights (GPT-2's, an exported model's; name: where they came from) with a run's dropout, cropped
    to its block_size, and pooled to its n_kv_head if given."""
    if vocab_size > model.config.vocab_size:
        raise UserError(f"the dataset's vocab_size={vocab_size} exceeds GPT-2's {model.config.vocab_size}: "
                        f"fine-tune GPT-2 on a GPT-2 BPE dataset (e.g. data/shakespeare)")
    learned = model.config.pos_encoding == "learned"
    if learned and block_size > model.config.block_size:
        raise UserError(f"block_size={block_size} is beyond the {model.config.block_size} positions {name}'s "
                        f"weights learned: give block_size <= {model.config.block_size}")
    config = replace(model.config, dropout=dropout, block_size=min(block_size, model.config.block_size) if learned
                     else block_size)  # rotary positions are computed, not learned: any block_size
    state = model.state_dict()
    if "transformer.wpe.weight" in state:
        state["transformer.wpe.weight"] = state["transformer.wpe.weight"][: config.block_size]
    model = GPT(config)
    model.load_state_dict(state)
    return convert_kv_heads(model, n_kv_head) if n_kv_head and n_kv_head != model.config.n_kv_head else model


CONVERT_METHODS = ("mean", "first", "random")


def convert_kv_heads(model: GPT, n_kv_head: int, method: str = "mean", seed: int = 0) -> GPT:
    """A copy of model with n_kv_head K/V heads, query, output and every other weight unchanged; each new K (and V)
    head is, by method (the GQA paper's ablation, https://arxiv.org/abs/2305.13245 s2.1 and fig. 5), the mean of
    the heads of its group, the first head of its group, or drawn afresh as a new model made with seed would be."""
    old = model.config.n_kv_head
    try:
        config = replace(model.config, n_kv_head=n_kv_head)  # checks that n_kv_head divides n_head
    except ValueError as e:
        raise UserError(f"cannot convert the model to n_kv_head={n_kv_head}: {e}") from e
    if old % n_kv_head:
        raise UserError(f"cannot pool the model's {old} K/V heads into n_kv_head={n_kv_head} groups: "
                        f"n_kv_head must divide {old}")
    converted = GPT(config).to(next(model.parameters()).device)
    if method == "random":
        converted.init_weights(seed)
    fresh, state = converted.state_dict(), model.state_dict()
    for name, t in state.items():
        if name.endswith(("attn.c_k.weight", "attn.c_k.bias", "attn.c_v.weight", "attn.c_v.bias")):
            # (old * head_dim, ...) -> (n_kv_head, old / n_kv_head, head_dim, ...) -> one head per group
            grouped = t.view(n_kv_head, old // n_kv_head, config.head_dim, *t.shape[1:])
            pooled = {"mean": grouped.mean(dim=1), "first": grouped[:, 0], "random": None}[method]
            state[name] = fresh[name] if pooled is None else pooled.reshape(n_kv_head * config.head_dim, *t.shape[1:])
    converted.load_state_dict(state)
    return converted
