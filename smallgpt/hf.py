"""This project's GPT as a stock Hugging Face transformers model (no code of ours needed to load
it): rotary positions as Starcoder2ForCausalLM (any n_kv_head), learned positions as GPT2LMHeadModel
(MHA; GQA with each K/V head repeated for its group, exact but without the smaller cache) or
GPTBigCodeForCausalLM with multi_query (MQA); Llama's block as LlamaForCausalLM (with local layers:
GraniteSWAForCausalLM), MLA as DeepseekV3ForCausalLM (smallgpt/hf_llama.py). The weight mapping, the
tokenizer as a transformers one, and llama.cpp's converter from such a folder to GGUF; export.py
writes the folder with a model card. Dropout is training's only: the exported model has none.
"""

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from model import GPT, GPTConfig
from smallgpt.errors import UserError, first_line
from smallgpt.hf_kimi import MODEL_TYPE as KIMI_TYPE
from smallgpt.hf_kimi import check_kimi, from_kimi_linear, kimi_linear, wants_kimi
from smallgpt.hf_llama import (
    deepseek,
    from_llama_block,
    granite_swa,
    llama,
    llama_class,
    shape_config,
    shape_of,
)
from smallgpt.hf_qwen import MODEL_TYPE as QWEN_TYPE
from smallgpt.hf_qwen import check_qwen, from_qwen35, qwen35, wants_qwen
from smallgpt.tokenizer import EOT, gpt2_encoding

# a block's modules: ours -> Starcoder2's
STARCODER2_LAYER = {
    "attn.c_q": "self_attn.q_proj",
    "attn.c_k": "self_attn.k_proj",
    "attn.c_v": "self_attn.v_proj",
    "attn.c_proj": "self_attn.o_proj",
    "mlp.c_fc": "mlp.c_fc",
    "mlp.c_proj": "mlp.c_proj",
    "ln_1": "input_layernorm",
    "ln_2": "post_attention_layernorm",
}


# OpenAI's GPT-2 on the Hugging Face hub
GPT2_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")


State = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Target:
    """An export target: a stock transformers class and what moves a model to it and back. holds:
    whether it is the class for a config (TARGETS' first that holds one is its class), raising
    the UserError of what the class needs where the config is of its family but lacks some of it;
    write: our config, weights and whether llama.cpp's converter reads it -> the class's name,
    config and weights; model_types and read: the folders it reads back (config.json's
    model_type -> our config and weights). A new family is a row (docs/architecture.md "Adding an
    export target")."""

    name: str
    holds: Callable[[GPTConfig], bool]
    write: Callable[[GPTConfig, State, bool], tuple[str, Any, State]]
    model_types: tuple[str, ...]
    read: Callable[[str, Any, State], tuple[GPTConfig, State]] | None


def holds_kimi(c: GPTConfig) -> bool:
    """KDA layers: Kimi Linear's class alone holds them (check_kimi says what else it needs)."""
    if not wants_kimi(c):
        return False
    check_kimi(c)
    return True


def holds_qwen(c: GPTConfig) -> bool:
    """Gated DeltaNet layers or Qwen3.5's attention options: Qwen3.5's class (check_qwen)."""
    if not wants_qwen(c):
        return False
    check_qwen(c)
    return True


def llama_family(name: str) -> Callable[[GPTConfig], bool]:
    """Whether hf_llama.llama_class picks this class of Llama's block (it refuses a model no stock
    class holds exactly)."""
    return lambda c: llama_class(c) == name


def write_starcoder2(c: GPTConfig, sd: State, llama_cpp: bool) -> tuple[str, Any, State]:
    """starcoder2, with zero biases where llama.cpp's converter reads it: its Starcoder2 requires
    them."""
    if llama_cpp and not c.bias:
        sd = sd | zero_biases(sd)
        c = dataclasses.replace(c, bias=True)
    return starcoder2(c, sd)


def read_starcoder2(folder: str, c: Any, sd: State) -> tuple[GPTConfig, State]:
    return only_its_own(*from_starcoder2(c, sd, gelu_of(folder, c, sd)))


def read_gpt_bigcode(folder: str, c: Any, sd: State) -> tuple[GPTConfig, State]:
    return only_its_own(*from_gpt_bigcode(c, sd, gelu_of(folder, c, sd)))


def only_its_own(config: GPTConfig, state: State) -> tuple[GPTConfig, State]:
    """config, and of state the weights a model of config has: a GPT-2 block's folder holds more
    (Starcoder2's zero LayerNorm biases where the model has none)."""
    with torch.device("meta"):
        names = GPT(config).state_dict().keys()
    return config, {ours: t for ours, t in state.items() if ours in names}


def gelu_of(folder: str, c: Any, sd: State) -> str:
    """A Starcoder2 or GPTBigCode folder's GELU ('exact' or 'tanh'), once unheld finds nothing
    this model cannot hold (else a UserError naming each)."""
    act = getattr(c, "hidden_act", None) or getattr(c, "activation_function", None)
    if bad := unheld(c, sd, act):
        raise UserError(f"{folder}: this model cannot hold {', '.join(bad)}")
    return "exact" if act == "gelu" else "tanh"


# The export targets, most specific first: a model goes to the first that holds it. Llama's
# block's three classes read back through one reader (hf_llama.from_llama_block); GPT-2's folders
# through from_hf (from_gpt2).
TARGETS = (
    Target(
        "KimiLinearForCausalLM",
        holds_kimi,
        lambda c, sd, llama_cpp: kimi_linear(c, sd),
        (KIMI_TYPE,),
        from_kimi_linear,
    ),
    Target(
        "Qwen3_5ForCausalLM",
        holds_qwen,
        lambda c, sd, llama_cpp: qwen35(c, sd),
        (QWEN_TYPE,),
        from_qwen35,
    ),
    Target(
        "DeepseekV3ForCausalLM",
        llama_family("DeepseekV3ForCausalLM"),
        deepseek,
        ("deepseek_v3",),
        from_llama_block,
    ),
    Target(
        "LlamaForCausalLM",
        llama_family("LlamaForCausalLM"),
        lambda c, sd, llama_cpp: llama(c, sd),
        ("llama",),
        from_llama_block,
    ),
    Target(
        "GraniteSWAForCausalLM",
        llama_family("GraniteSWAForCausalLM"),
        lambda c, sd, llama_cpp: granite_swa(c, sd),
        ("granite_swa",),
        from_llama_block,
    ),
    Target(
        "Starcoder2ForCausalLM",
        lambda c: c.pos_encoding == "rope",
        write_starcoder2,
        ("starcoder2",),
        read_starcoder2,
    ),
    Target(
        "GPTBigCodeForCausalLM",
        lambda c: c.attention_type == "MQA",
        lambda c, sd, llama_cpp: gpt2(c, sd),
        ("gpt_bigcode",),
        read_gpt_bigcode,
    ),
    Target(
        "GPT2LMHeadModel",
        lambda c: True,
        lambda c, sd, llama_cpp: gpt2(c, sd),
        ("gpt2",),
        None,
    ),
)


def target(config: GPTConfig) -> Target:
    """The export target of a model of config; one no class holds: a UserError."""
    # a kind of layer that no transformers class holds (its hf_layer_type is None)
    for kind in dict.fromkeys(config.layer_kinds):
        if kind.hf_layer_type is None:
            raise UserError(
                f"no transformers class holds {kind.name} layers ({kind.letter} in "
                f"layer_pattern={config.layer_letters!r}): this model cannot be exported"
            )
    return next(row for row in TARGETS if row.holds(config))


def target_class(config: GPTConfig) -> str:
    """The transformers class that holds a model of config; one that none holds: a UserError."""
    return target(config).name


def to_hf(model: GPT, llama_cpp: bool = False) -> Any:
    """A transformers model (float32, eval mode) that computes what model computes. llama_cpp: the
    one llama.cpp's converter reads (a rotary GPT-2 block gets zero biases: llama.cpp's Starcoder2
    requires them; MLA: hf_llama)."""
    import transformers

    c = model.config
    sd = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    cls_name, hf_config, state = target(c).write(c, sd, llama_cpp)
    hf = getattr(transformers, cls_name)(hf_config)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embeddings
    if missing or unexpected:
        raise AssertionError(
            f"weight mapping incomplete: missing {missing}, unexpected {unexpected}"
        )
    hf.tie_weights()
    return hf.eval()


def zero_biases(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A zero bias for each weight of sd's blocks but the norms'."""
    return {
        k.replace(".weight", ".bias"): torch.zeros(v.shape[0])
        for k, v in sd.items()
        if k.startswith("transformer.h.") and k.endswith(".weight") and ".ln_" not in k
    }


def starcoder2(c: Any, sd: dict[str, torch.Tensor]) -> tuple[str, Any, dict[str, torch.Tensor]]:
    """Rotary positions: Starcoder2's config and weights. It rotates halves of each head
    (rotate_half), as model.apply_rope does, and query head h reads K/V head
    h // (n_head / n_kv_head), as SDPA's enable_gqa."""
    import transformers

    config = transformers.Starcoder2Config(
        **shape_config(c),
        num_key_value_heads=c.n_kv_head,
        hidden_act="gelu" if c.gelu == "exact" else "gelu_pytorch_tanh",
        norm_epsilon=1e-5,
        use_bias=c.bias,
        rope_theta=c.rope_theta,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        sliding_window=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    zeros = torch.zeros(c.n_embd)
    state = {
        "model.embed_tokens.weight": sd["transformer.wte.weight"],
        "model.norm.weight": sd["transformer.ln_f.weight"],
        "model.norm.bias": sd.get("transformer.ln_f.bias", zeros),
    }
    for i in range(c.n_layer):
        for ours, theirs in STARCODER2_LAYER.items():
            for leaf in ("weight", "bias"):
                key = f"transformer.h.{i}.{ours}.{leaf}"
                if key in sd:
                    state[f"model.layers.{i}.{theirs}.{leaf}"] = sd[key]
                elif ours.startswith("ln"):  # nn.LayerNorm always has a bias
                    state[f"model.layers.{i}.{theirs}.{leaf}"] = zeros
    return "Starcoder2ForCausalLM", config, state


def gpt2(c: Any, sd: dict[str, torch.Tensor]) -> tuple[str, Any, dict[str, torch.Tensor]]:
    """Learned positions: GPTBigCode with multi_query for MQA, else GPT-2 (GQA's K/V heads repeated
    for their groups); both hold Q, K and V as one c_attn, and biases everywhere (zeros where the
    model has none)."""
    mqa = c.attention_type == "MQA"
    name = "GPTBigCodeForCausalLM" if mqa else "GPT2LMHeadModel"
    return name, gpt2_config(c, mqa), gpt2_state(c, sd, mqa)


def gpt2_config(c: Any, mqa: bool) -> Any:
    """The transformers config of gpt2's class: GPTBigCode's with multi_query, else GPT-2's."""
    import transformers

    common = dict(
        vocab_size=c.vocab_size,
        n_positions=c.block_size,
        n_embd=c.n_embd,
        n_layer=c.n_layer,
        n_head=c.n_head,
        n_inner=c.mlp_hidden,
        activation_function="gelu" if c.gelu == "exact" else "gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
    )
    if mqa:
        return transformers.GPTBigCodeConfig(multi_query=True, **common)
    # n_ctx: GPT-2's old name for n_positions, which llama.cpp's converter reads
    return transformers.GPT2Config(n_ctx=c.block_size, **common)


def repeated_heads(c: Any, t: torch.Tensor) -> torch.Tensor:
    """K or V rows (n_kv_head * head_dim, ...) with each head repeated for its group of query
    heads: (n_embd, ...), as GPT-2 holds them."""
    group = c.n_head // c.n_kv_head
    heads = t.view(c.n_kv_head, c.head_dim, *t.shape[1:])  # (n_kv_head, head_dim, ...)
    return heads.repeat_interleave(group, 0).reshape(c.n_embd, *t.shape[1:])


# a block's modules, each with a weight (and a bias, zeros where the model has none, in GPT-2)
GPT2_MODULES = (
    "attn.c_q",
    "attn.c_k",
    "attn.c_v",
    "attn.c_proj",
    "mlp.c_fc",
    "mlp.c_proj",
    "ln_1",
    "ln_2",
)


def gpt2_state(c: Any, sd: dict[str, torch.Tensor], mqa: bool) -> dict[str, torch.Tensor]:
    """gpt2's weights: Q, K and V in one c_attn, a bias for each module. GPT-2's Conv1D stores
    (in, out) and every head; GPTBigCode's multi-query Linear stores (out, in) and one K/V head."""

    def kv(t: torch.Tensor) -> torch.Tensor:
        return t if mqa else repeated_heads(c, t)

    def conv(t: torch.Tensor) -> torch.Tensor:
        return t if mqa else t.t()

    kept = ("transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight")
    state = {k: sd[k] for k in kept}
    state["transformer.ln_f.bias"] = sd.get("transformer.ln_f.bias", torch.zeros(c.n_embd))
    for i in range(c.n_layer):
        p = f"transformer.h.{i}."
        w = {n: sd[p + f"{n}.weight"] for n in GPT2_MODULES}
        b = {n: sd.get(p + f"{n}.bias", torch.zeros(t.shape[0])) for n, t in w.items()}
        qkv_weight = [w["attn.c_q"], kv(w["attn.c_k"]), kv(w["attn.c_v"])]
        qkv_bias = [b["attn.c_q"], kv(b["attn.c_k"]), kv(b["attn.c_v"])]
        state[p + "attn.c_attn.weight"] = conv(torch.cat(qkv_weight))
        state[p + "attn.c_attn.bias"] = torch.cat(qkv_bias)
        for n in ("attn.c_proj", "mlp.c_fc", "mlp.c_proj", "ln_1", "ln_2"):
            is_linear = "." in n  # not a norm
            state[p + f"{n}.weight"] = conv(w[n]) if is_linear else w[n]
            state[p + f"{n}.bias"] = b[n]
    return state


def from_transformers(folder: str) -> GPT:
    """This project's model from a folder of one of TARGETS' classes but GPT-2's (what export.py
    writes for all but GPT-2: Starcoder2, GPTBigCode, Llama, GraniteSWA, DeepSeek-V3, Qwen3.5,
    Kimi Linear); what this model cannot hold (untied embeddings, a sliding window shorter than
    the positions, another norm epsilon, activation or rope type, experts, ...) is refused in one
    line. GPT-2 folders: from_hf."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder)
    c = hf.config
    sd = {k: v.float() for k, v in hf.state_dict().items()}
    row = next((row for row in TARGETS if c.model_type in row.model_types and row.read), None)
    if row is None:  # GPT-2's folders are from_hf's; any other type no row reads
        raise UserError(
            f"{folder}: model_type {c.model_type!r} is none that from_transformers reads "
            f"({', '.join(t for row in TARGETS if row.read for t in row.model_types)}): "
            "load a GPT-2 folder with from_hf"
        )
    config, state = row.read(folder, c, sd)
    return with_weights(GPT(config), state)


def unheld(c: Any, sd: dict[str, torch.Tensor], act: str | None) -> list[str]:
    """What a Starcoder2 or GPTBigCode config c (activation act) and its weights sd hold that this
    model cannot, each as the setting that says it."""
    window = getattr(c, "sliding_window", None)
    eps = getattr(c, "norm_epsilon", getattr(c, "layer_norm_epsilon", 0))
    rope = (getattr(c, "rope_parameters", None) or {}).get("rope_type", "default")
    norm_biases = ("layernorm.bias", "model.norm.bias")
    ln_bias = any(sd[k].any() for k in sd if k.endswith(norm_biases))
    short_window = window is not None and window < getattr(c, "max_position_embeddings", 0)
    not_mqa = c.model_type == "gpt_bigcode" and not c.multi_query
    only_ln_bias = c.model_type == "starcoder2" and not c.use_bias and ln_bias
    problems = {
        f"tie_word_embeddings={c.tie_word_embeddings}": not c.tie_word_embeddings,
        f"hidden_act={act!r}": act not in ("gelu", "gelu_pytorch_tanh", "gelu_new"),
        f"sliding_window={window}": short_window,
        f"norm epsilon {eps}": eps != 1e-5,
        f"rope_type={rope!r}": rope != "default",
        "multi_query=False": not_mqa,
        "LayerNorm biases with use_bias=False": only_ln_bias,
    }
    return [what for what, true in problems.items() if true]


def from_starcoder2(
    c: Any, sd: dict[str, torch.Tensor], gelu: str
) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """A Starcoder2 config as ours, and its weights under our names (more than the model may
    take: a LayerNorm's zero biases where it has none)."""
    config = GPTConfig(
        **shape_of(c),
        n_kv_head=c.num_key_value_heads,
        bias=c.use_bias,
        pos_encoding="rope",
        rope_theta=float(c.rope_parameters["rope_theta"]),
        gelu=gelu,
    )
    names = {
        "transformer.wte.weight": "model.embed_tokens.weight",
        "transformer.ln_f.weight": "model.norm.weight",
        "transformer.ln_f.bias": "model.norm.bias",
    }
    names |= {
        f"transformer.h.{i}.{ours}.{kind}": f"model.layers.{i}.{theirs}.{kind}"
        for i in range(c.num_hidden_layers)
        for ours, theirs in STARCODER2_LAYER.items()
        for kind in ("weight", "bias")
    }
    return config, {ours: sd[theirs] for ours, theirs in names.items() if theirs in sd}


def from_gpt_bigcode(
    c: Any, sd: dict[str, torch.Tensor], gelu: str
) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """A multi-query GPTBigCode config as ours, and its weights under our names: Q, K and V are
    one c_attn there (an nn.Linear), and every module has a bias."""
    config = GPTConfig(
        block_size=c.n_positions,
        vocab_size=c.vocab_size,
        n_layer=c.n_layer,
        n_head=c.n_head,
        n_kv_head=1,
        n_embd=c.n_embd,
        bias=True,
        pos_encoding="learned",
        gelu=gelu,
        mlp_hidden=c.n_inner or 4 * c.n_embd,
    )
    state = {k: t for k, t in sd.items() if "c_attn" not in k and k != "lm_head.weight"}
    sizes = [c.n_embd, config.head_dim, config.head_dim]  # all query heads, one K, one V
    for i in range(c.n_layer):
        p = f"transformer.h.{i}.attn."
        for kind in ("weight", "bias"):
            q, k, v = sd[f"{p}c_attn.{kind}"].split(sizes)
            state[f"{p}c_q.{kind}"] = q
            state[f"{p}c_k.{kind}"] = k
            state[f"{p}c_v.{kind}"] = v
    return config, state


def with_weights(model: GPT, state: dict[str, torch.Tensor]) -> GPT:
    """model with state's weights, every one given (strict), its output layer tied to the
    embeddings."""
    model.load_state_dict(state | {"lm_head.weight": state["transformer.wte.weight"]})
    return model


# a char-level tokenizer's unknown token: more than one character, so never in its vocabulary
UNKNOWN = "<unk>"


def tokenizer(meta: dict) -> Any:
    """The dataset's tokenizer as a transformers fast tokenizer: char-level (one token per character
    of the dataset's list), GPT-2's BPE (from tiktoken's ranks, offline from $GPT2_BPE_FILE), or the
    dataset's own BPE."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if meta.get("tokenizer") == "char":
        chars = meta["chars"]
        # the unknown token is in no vocabulary of single characters: a character outside the
        # dataset's is refused (tokenizers raises), never read as one of its characters
        tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token=UNKNOWN))
        every_character = Regex(r"[\s\S]")
        tok.pre_tokenizer = pre_tokenizers.Split(every_character, behavior="isolated")
        tok.decoder = decoders.Fuse()  # joined with nothing between
        return PreTrainedTokenizerFast(tokenizer_object=tok)
    if meta.get("tokenizer") == "gpt2":
        from transformers.convert_slow_tokenizer import TikTokenConverter

        enc = gpt2_encoding()
        specials = sorted(enc._special_tokens, key=enc._special_tokens.get)
        after_ranks = range(len(enc._mergeable_ranks), enc.n_vocab)
        assert [enc._special_tokens[t] for t in specials] == list(after_ranks)
        converter = TikTokenConverter(pattern=enc._pat_str, extra_special_tokens=specials)
        # the ranks tiktoken holds, whatever the file
        converter.load_tiktoken_bpe = lambda _: enc._mergeable_ranks
        eot = {"eos_token": EOT, "bos_token": EOT} if enc.eot_token is not None else {}
        return PreTrainedTokenizerFast(tokenizer_object=converter.converted(), **eot)
    if meta.get("tokenizer") == "bpe":
        return PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer.from_str(meta["bpe"]), eos_token=EOT, bos_token=EOT
        )
    raise UserError(f"unknown tokenizer {meta.get('tokenizer')!r} in the checkpoint's dataset meta")


def save(hf_model: Any, tok: Any, folder: Path) -> None:
    """hf_model and tok into folder (save_pretrained), loadable by transformers 5 and by 4.57 (the
    version llama.cpp's converter pins): 4.57 knows no TokenizersBackend class and reads the rotary
    base only from a top-level rope_theta, 5 only from rope_parameters, so both are written
    (docs/export.md)."""
    hf_model.save_pretrained(folder)
    tok.save_pretrained(folder)
    update_json(folder / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast"})
    rope = json.loads((folder / "config.json").read_text()).get("rope_parameters")
    if rope:
        update_json(folder / "config.json", {"rope_theta": rope["rope_theta"]})


def update_json(file: Path, fields: dict) -> None:
    """The JSON object in file with fields set."""
    file.write_text(
        json.dumps(json.loads(file.read_text()) | fields, indent=2, sort_keys=True) + "\n"
    )


def check_weights(folder: Path) -> None:
    """Each *.safetensors file in folder whole (its header read, its tensors' bytes all there), else
    one line naming it: a truncated copy would otherwise fail inside safetensors with a
    traceback."""
    from safetensors import SafetensorError, safe_open

    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(file, "pt"):
                pass
        except (SafetensorError, OSError) as e:
            raise UserError(
                f"{file} is damaged or truncated ({e}): copy or save the folder again"
            ) from e


def from_hf(name_or_path: str) -> GPT:
    """OpenAI's GPT-2 through Hugging Face transformers: a hub name ('gpt2', 'gpt2-medium',
    'gpt2-large', 'gpt2-xl') or a local folder written by save_pretrained (from_gpt2). A
    Starcoder2, GPTBigCode, Llama or DeepSeek-V3 folder (as export.py writes) goes through
    hf.from_transformers."""
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    # a local folder: from_pretrained would take a wrong one for a hub id
    if name_or_path not in GPT2_NAMES:
        kind = folder_model_type(Path(name_or_path))
        if kind != "gpt2":  # what export.py writes for all but GPT-2
            return from_transformers(name_or_path)
    try:
        hf = GPT2LMHeadModel.from_pretrained(name_or_path)
    except OSError as e:  # what transformers raises for no network, no cache or a bad folder
        raise UserError(
            f"cannot load GPT-2 weights {name_or_path!r} ({first_line(e)}): with no network, "
            f"fill the Hugging Face cache once online, or pass a folder saved by save_pretrained"
        ) from e
    return from_gpt2(hf)


def folder_model_type(folder: Path) -> str:
    """The model_type of the save_pretrained folder, one from_hf loads; a UserError where there is
    none, its weights are damaged, or no loader of ours reads it."""
    if not (folder / "config.json").is_file():
        raise UserError(
            f"no Hugging Face model folder at {folder} (no config.json): pass a folder saved "
            f"by save_pretrained, or one of {', '.join(GPT2_NAMES)}"
        )
    check_weights(folder)  # a truncated copy: one line naming the file
    try:
        kind = json.loads((folder / "config.json").read_text()).get("model_type")
    except (ValueError, AttributeError):
        kind = None
    if kind not in {t for row in TARGETS for t in row.model_types}:
        raise UserError(
            f"{folder} is not a GPT-2, Starcoder2 or GPTBigCode folder saved by "
            "save_pretrained, nor a Llama, DeepSeek-V3, Qwen3.5 or Kimi Linear one (config.json's "
            f"model_type is {kind!r}); a checkpoint of this project loads with init_from=resume "
            "and out_dir"
        )
    return kind


def from_gpt2(hf: Any) -> GPT:
    """This project's model from a GPT2LMHeadModel: its fused c_attn is split into c_q, c_k, c_v
    and its Conv1D weights, stored (in, out), are transposed to Linear's (out, in)."""
    c = hf.config
    config = GPTConfig(
        block_size=c.n_positions,
        vocab_size=c.vocab_size,
        n_layer=c.n_layer,
        n_head=c.n_head,
        n_embd=c.n_embd,
        bias=True,
        gelu="tanh" if c.activation_function == "gelu_new" else "exact",
        mlp_hidden=c.n_inner,  # None: 4 * n_embd, as GPT-2's own
    )
    model = GPT(config)
    state = {}
    for name, t in hf.state_dict().items():
        if ".attn.c_attn." not in name:
            conv1d = name.endswith(("c_proj.weight", "c_fc.weight"))
            state[name] = t.t() if conv1d else t
            continue
        pieces = t.split(c.n_embd, dim=-1)
        for part, piece in zip(("c_q", "c_k", "c_v"), pieces, strict=True):
            is_weight = name.endswith("weight")
            state[name.replace("c_attn", part)] = piece.t() if is_weight else piece
    model.load_state_dict(state)
    return model
