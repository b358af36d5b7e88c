"""Conversions of a model's weights: MHA -> GQA/MQA by pooling K/V heads (the GQA paper's uptraining
start, and its ablations), MHA -> MLA by MHA2MLA's partial RoPE and joint SVD, and pretrained
weights fitted to the run that fine-tunes them.
"""

import math
from dataclasses import dataclass, field, replace

import torch

from model import GPT, GPTConfig
from smallgpt import hybridize
from smallgpt.errors import UserError


@dataclass
class HybridSteer:
    """How attention becomes a hybrid (TrainConfig's convert_layers and convert_calibrate), and
    the (inputs, targets) batches ranking and calibration read."""

    layers: str = "given"
    calibrate: bool = False
    batches: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


def for_finetuning(
    model: GPT, name: str, vocab_size: int, dropout: float, block_size: int, n_kv_head: int | None
) -> GPT:
    """Pretrained weights (GPT-2's, an exported model's; name: where they came from) with a run's
    dropout, cropped to its block_size, and pooled to its n_kv_head if given."""
    if vocab_size > model.config.vocab_size:
        raise UserError(
            f"the dataset's vocab_size={vocab_size} exceeds GPT-2's {model.config.vocab_size}: "
            f"fine-tune GPT-2 on a GPT-2 BPE dataset (e.g. data/shakespeare)"
        )
    learned = model.config.pos_encoding == "learned"
    if learned and block_size > model.config.block_size:
        raise UserError(
            f"block_size={block_size} is beyond the {model.config.block_size} positions {name}'s "
            f"weights learned: give block_size <= {model.config.block_size}"
        )
    if learned:  # rotary positions are computed, not learned: any block_size
        block_size = min(block_size, model.config.block_size)
    config = replace(model.config, dropout=dropout, block_size=block_size)
    state = model.state_dict()
    if "transformer.wpe.weight" in state:
        state["transformer.wpe.weight"] = state["transformer.wpe.weight"][: config.block_size]
    model = GPT(config)
    model.load_state_dict(state)
    if n_kv_head and n_kv_head != model.config.n_kv_head:
        return convert_kv_heads(model, n_kv_head)
    return model


CONVERT_METHODS = ("mean", "first", "random")


def convert_kv_heads(model: GPT, n_kv_head: int, method: str = "mean", seed: int = 0) -> GPT:
    """A copy of model with n_kv_head K/V heads, query, output and every other weight unchanged;
    each new K (and V) head is, by method (the GQA paper's ablation,
    https://arxiv.org/abs/2305.13245 s2.1 and fig. 5), the mean of the heads of its group, the first
    head of its group, or drawn afresh as a new model made with seed would be."""
    old = model.config.n_kv_head
    try:
        config = replace(model.config, n_kv_head=n_kv_head)  # checks that n_kv_head divides n_head
    except ValueError as e:
        raise UserError(f"cannot convert the model to n_kv_head={n_kv_head}: {e}") from e
    if old % n_kv_head:
        raise UserError(
            f"cannot pool the model's {old} K/V heads into n_kv_head={n_kv_head} groups: "
            f"n_kv_head must divide {old}"
        )
    converted = GPT(config).to(next(model.parameters()).device)
    if method == "random":
        converted.init_weights(seed)
    fresh = converted.state_dict()
    state = model.state_dict()
    kv_names = ("attn.c_k.weight", "attn.c_k.bias", "attn.c_v.weight", "attn.c_v.bias")
    for name, t in state.items():
        if not name.endswith(kv_names):
            continue
        if method == "random":
            state[name] = fresh[name]
            continue
        # (old * head_dim, ...) -> (n_kv_head, old / n_kv_head, head_dim, ...)
        grouped = t.view(n_kv_head, old // n_kv_head, config.head_dim, *t.shape[1:])
        # one head per group: (n_kv_head, head_dim, ...)
        pooled = grouped.mean(dim=1) if method == "mean" else grouped[:, 0]
        state[name] = pooled.reshape(n_kv_head * config.head_dim, *t.shape[1:])
    converted.load_state_dict(state)
    return converted


# the model keys a conversion may change (train.py's --init_from=convert: takes the source's others)
CONVERTED_KEYS = (
    "n_kv_head",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "latent_norm",
    "layer_pattern",
    "window_pattern",
)


def for_uptraining(
    model: GPT, target: GPTConfig, method: str, seed: int, hybrid: HybridSteer | None = None
) -> GPT:
    """The MHA model converted to the target's attention, for train.py's --init_from=convert: a
    hybrid where the target's layer_pattern has D (its attention layers pooled to n_kv_head first;
    smallgpt/hybridize.py), MLA where it sets kv_lora_rank (to_latent), else target.n_kv_head K/V
    heads pooled by method (convert_kv_heads)."""
    steer = hybrid or HybridSteer()
    if target.recurrent_layers == model.config.recurrent_layers and steer.layers != "given":
        raise UserError(
            f"convert_layers={steer.layers!r} ranks which layers stay attention in a conversion "
            f"into a hybrid, and layer_pattern={target.layer_letters!r} makes no layer recurrent: "
            f"give a layer_pattern with {hybridize.recurrent_letter()} layers, or leave "
            f"convert_layers out"
        )
    if target.recurrent_layers != model.config.recurrent_layers:
        if target.attention_type == "MLA":
            raise UserError("a hybrid is converted from MHA, GQA or MQA: leave kv_lora_rank out")
        if target.n_kv_head != model.config.n_kv_head:
            model = convert_kv_heads(model, target.n_kv_head, method, seed)
        return hybridize.for_uptraining(
            model, target.layer_letters, steer.layers, steer.calibrate, steer.batches, seed
        )
    if target.attention_type != "MLA":
        return convert_kv_heads(model, target.n_kv_head, method, seed)
    # an RMSNorm on the latent has no MHA counterpart: the converted model has none
    if target.latent_norm:
        raise UserError(
            "converting to MLA (kv_lora_rank) gives a model without the latent's RMSNorm: add "
            "--latent_norm=False"
        )
    if method != "mean":
        raise UserError(
            f"convert_method={method!r} pools K/V heads; MLA's conversion is MHA2MLA's joint SVD, "
            f"which has no method to choose: leave convert_method out"
        )
    return to_latent(model, target.kv_lora_rank, target.qk_rope_head_dim)


def to_latent(model: GPT, kv_lora_rank: int, qk_rope_head_dim: int | None = None) -> GPT:
    """A copy of an MHA model as MLA without the latent's norm (latent_norm=False), every weight
    outside attention unchanged, by MHA2MLA (https://arxiv.org/abs/2502.14837): partial RoPE keeping
    every (head_dim / qk_rope_head_dim)-th frequency (section 3.1, S_uniform), then one SVD of each
    layer's keys and values together (section 3.2, SVD_joint). With learned positions it is exact at
    kv_lora_rank = n_embd (docs/compare.md)."""
    source = model.config
    if source.attention_type != "MHA":
        raise UserError(
            f"MLA conversion starts from an MHA model, and this one is {source.attention_type} "
            f"(n_head={source.n_head}, n_kv_head={source.n_kv_head}): convert the MHA run instead"
        )
    kept = {
        f"layer_pattern={source.layer_letters!r}": bool(source.recurrent_layers),
        f"attn_gate={source.attn_gate!r}": source.attn_gate != "none",
        "qk_norm=True": source.qk_norm,
        f"rope_fraction={source.rope_fraction}": source.rope_fraction != 1,
    }
    if unheld := [key for key, has in kept.items() if has]:
        raise UserError(
            f"MLA conversion maps plain attention layers (MHA2MLA), and this model has "
            f"{', '.join(unheld)}: convert a run without them"
        )
    try:
        config = replace(
            source,
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=qk_rope_head_dim,
            q_lora_rank=None,
            latent_norm=False,
        )
    except ValueError as e:
        raise UserError(f"cannot convert the model to MLA: {e}") from e
    check_latent_target(config)
    converted = GPT(config).to(next(model.parameters()).device)
    state = model.state_dict()
    for layer in range(config.n_layer):
        prefix = f"transformer.h.{layer}.attn."
        mha = {
            name.removeprefix(prefix): state.pop(name)
            for name in list(state)
            if name.startswith(prefix)
        }
        state |= {prefix + name: t for name, t in latent_attention(mha, config).items()}
    converted.load_state_dict(state)
    return converted


def check_latent_target(config: GPTConfig) -> None:
    """That an MHA model converts to the MLA config (to_latent), else a UserError saying why: its
    rotary width must divide head_dim (MLA's frequencies are then MHA's) and its latent be no wider
    than n_embd (W_kv's rank at most)."""
    head_dim = config.head_dim
    rope_dim = config.qk_rope_head_dim
    rank = config.kv_lora_rank
    if rope_dim and head_dim % rope_dim:
        fits = [d for d in range(2, head_dim + 1, 2) if head_dim % d == 0]
        raise UserError(
            f"qk_rope_head_dim={rope_dim} does not divide head_dim={head_dim}: MLA's rotary "
            f"frequencies are MHA's only for one of {fits}"
        )
    if rank > config.n_embd:
        raise UserError(
            f"kv_lora_rank={rank} exceeds n_embd={config.n_embd}, the most the joint key and "
            f"value map's rank can be: give kv_lora_rank <= {config.n_embd}"
        )


def rotary_features(head_dim: int, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The features of an MHA head that stay rotary in MLA, in the MLA rotary key's order, and the
    others (NoPE). MHA rotates pairs (i, i + head_dim/2) at theta^(-2i/head_dim), MLA pairs
    (j, j + rope_dim/2) at theta^(-2j/rope_dim): the same frequency where
    i = j head_dim / rope_dim (S_uniform)."""
    step = head_dim // rope_dim if rope_dim else 1
    first = torch.arange(rope_dim // 2) * step  # the pairs' first features, i < head_dim / 2
    rope = torch.cat((first, first + head_dim // 2))
    kept = torch.ones(head_dim, dtype=torch.bool)
    kept[rope] = False
    return rope, kept.nonzero().flatten()


def padded(t: torch.Tensor, width: int) -> torch.Tensor:
    """t (heads, n, ...) with zero rows appended along dim 1 up to width."""
    return torch.cat((t, t.new_zeros(t.shape[0], width - t.shape[1], *t.shape[2:])), dim=1)


@torch.no_grad()
def latent_attention(mha: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """One layer's LatentAttention weights from its CausalSelfAttention weights (MHA), named as in
    the modules.

    Each head's query is [its NoPE features, zero-padded to head_dim | its rotary ones], scaled by
    sqrt((head_dim + rope_dim) / head_dim) since MLA divides scores by sqrt(head_dim + rope_dim),
    MHA by sqrt(head_dim). The rotary key shared by the heads is the mean of theirs. kv_b's rows
    hold each head's [key's NoPE features, zero-padded | value]: W_kv = U S V^T, truncated to
    kv_lora_rank, is split as kv_b = U sqrt(S) and kv_a's latent rows = sqrt(S) V^T. Biases: the
    key's NoPE bias adds the same to all of a query's scores (softmax ignores it: dropped); the
    value's comes out of attention unchanged (weights sum to one: into c_proj's bias)."""
    H = config.n_head
    hd = config.head_dim
    R = config.kv_lora_rank
    r = config.qk_rope_head_dim
    rope, nope = rotary_features(hd, r)
    q_scale = math.sqrt((hd + r) / hd)
    heads = {
        name: t.unflatten(0, (H, hd)) for name, t in mha.items() if not name.startswith("c_proj")
    }

    def query(t: torch.Tensor) -> torch.Tensor:  # (H, hd, ...) -> (H * (hd + r), ...)
        return q_scale * torch.cat((padded(t[:, nope], hd), t[:, rope]), dim=1).flatten(0, 1)

    k = heads["c_k.weight"]  # (H, hd, n_embd)
    v = heads["c_v.weight"]  # (H, hd, n_embd)
    w_kv = torch.stack((padded(k[:, nope], hd), v), dim=1)  # (H, 2, hd, n_embd)
    w_kv = w_kv.flatten(0, 2)  # (2 * n_embd, n_embd), kv_b's rows
    u, s, vh = torch.linalg.svd(w_kv.double(), full_matrices=False)
    root = s[:R].sqrt()
    out = {
        "c_q.weight": query(heads["c_q.weight"]),
        "c_proj.weight": mha["c_proj.weight"],
        "kv_a.weight": torch.cat(((root[:, None] * vh[:R]).to(k.dtype), k[:, rope].mean(0))),
        "kv_b.weight": (u[:, :R] * root).to(k.dtype),
    }
    if "c_q.bias" in mha:
        k_rope_bias = heads["c_k.bias"][:, rope].mean(0)
        out["c_q.bias"] = query(heads["c_q.bias"])
        out["kv_a.bias"] = torch.cat((k_rope_bias.new_zeros(R), k_rope_bias))
        out["c_proj.bias"] = mha["c_proj.bias"] + mha["c_proj.weight"] @ mha["c_v.bias"]
    return out
