"""Kimi Linear's hybrid (Kimi Delta Attention layers beside MLA layers without positions) as
transformers' KimiLinearForCausalLM, dense (every MLP Llama's: mlp_layer_types all 'dense'), both
ways; what the class cannot hold is refused in one line before anything is written. smallgpt/hf.py
calls these (docs/export.md "Kimi Linear").

The class matches ours by construction but in three places: its KDA has q_proj, k_proj and v_proj
where ours has one c_qkv, its A_log is shaped (1, 1, heads, 1), and it does not tie its output
head to the embeddings, so the folder holds the embeddings twice. Its MLA is DeepSeek-V3's, latents
scaled as hf_llama.deepseek scales them, with the rotary features never rotated (NoPE)."""

from typing import Any

import torch

from attention import NORM_EPS
from layer_kind import LayerKind
from model import GPTConfig
from model_config import pattern_keys
from smallgpt.errors import UserError
from smallgpt.hf_llama import (
    DEEPSEEK_LAYER,
    LATENT_SCALE,
    kinds_config,
    kinds_of,
    latent_rows,
    shape_config,
    shape_of,
)

MODEL_TYPE = "kimi_linear"
# the layer types Kimi Linear's class holds (each kind's hf_layer_type names its own)
LAYER_TYPES = ("full_attention", "linear_attention")
# a block's parameters but its mixer's, ours -> Kimi Linear's (Llama's norms and MLP)
BLOCK = {
    f"{a}.weight": f"{b}.weight" for a, b in DEEPSEEK_LAYER.items() if not a.startswith("attn.")
}
# an MLA layer's, ours -> DeepSeek-V3's (its kv_a and q_a rows scaled: latent_rows)
MLA = {f"{a}.weight": f"{b}.weight" for a, b in DEEPSEEK_LAYER.items() if a.startswith("attn.")}


def wants_kimi(c: GPTConfig) -> bool:
    """Whether c has layers only Kimi Linear's class holds (Kimi Delta Attention)."""
    return any(kind.hf_model == MODEL_TYPE for kind in c.layer_kinds)


def check_kimi(c: GPTConfig) -> None:
    """A UserError naming every key KimiLinearForCausalLM needs that c lacks."""
    kinds = {kind for kind in c.layer_kinds if kind.hf_model not in (None, MODEL_TYPE)}
    attention = [i for i, kind in enumerate(c.layer_kinds) if kind.attends]
    needs = {
        "norm='rmsnorm' and mlp='swiglu'": (c.norm, c.mlp) != ("rmsnorm", "swiglu"),
        "pos_encoding='rope'": c.pos_encoding != "rope",
        "bias=False": c.bias,
        "MLA (kv_lora_rank)": bool(attention) and c.kv_lora_rank is None,
        "latent_norm=True": not c.latent_norm,
        "no local layers (window)": c.window is not None,
        "no sinks (attn_sinks)": c.attn_sinks,
        "no positions on the attention layers (rope_pattern='N')": any(
            c.layers[i].rotary for i in attention
        ),
        "no other recurrent layers": bool(kinds),
    }
    if missing := [key for key, needed in needs.items() if needed]:
        raise UserError(
            f"export needs {', '.join(missing)} for Kimi Delta Attention layers "
            "(KimiLinearForCausalLM: Llama's block, no biases, its attention layers global MLA "
            "without positions)"
        )


def kimi_config(c: GPTConfig) -> Any:
    """KimiLinearConfig of c, dense: its KDA heads are c's heads."""
    from transformers import KimiLinearConfig

    layer_keys = kinds_config(c)
    shape = shape_config(c) | dict(tie_word_embeddings=False)  # the class ties nothing
    return KimiLinearConfig(
        **shape,
        num_key_value_heads=c.n_head,
        hidden_act="silu",
        rms_norm_eps=NORM_EPS,
        attention_bias=False,
        kv_lora_rank=c.kv_lora_rank or 1,  # 1: no layer attends, so no MLA is built
        q_lora_rank=c.q_lora_rank,
        qk_rope_head_dim=c.qk_rope_head_dim or 0,
        qk_nope_head_dim=c.head_dim,
        v_head_dim=c.head_dim,
        layer_types=[kind.hf_layer_type for kind in c.layer_kinds],
        mlp_layer_types=["dense"] * c.n_layer,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
        **layer_keys,
    )


def layer_names(kind: type[LayerKind]) -> dict[str, str]:
    """A layer's parameters, ours -> Kimi Linear's, but KDA's c_qkv (three Linears there): the
    block's, and its kind's."""
    mixer = MLA if kind.attends else {f"attn.{a}": b for a, b in kind.hf_names.items()}
    return BLOCK | mixer


def kimi_linear(
    c: GPTConfig, sd: dict[str, torch.Tensor]
) -> tuple[str, Any, dict[str, torch.Tensor]]:
    """Kimi Linear's config and weights (hf.target_class has checked that the class holds c)."""
    state = {
        "model.embed_tokens.weight": sd["transformer.wte.weight"],
        "model.norm.weight": sd["transformer.ln_f.weight"],
        "lm_head.weight": sd["transformer.wte.weight"].clone(),
    }
    for i, kind in enumerate(c.layer_kinds):
        ours = f"transformer.h.{i}."
        theirs = f"model.layers.{i}."
        for a, b in layer_names(kind).items():
            if ours + a in sd:
                state[theirs + b] = sd[ours + a]
        p = theirs + "self_attn."
        if kind.attends:
            latent_rows(state, p, c, LATENT_SCALE)
        else:
            q, k, v = sd[ours + "attn.c_qkv.weight"].chunk(3)
            state |= {p + "q_proj.weight": q, p + "k_proj.weight": k, p + "v_proj.weight": v}
            state[p + "forget_gate.A_log"] = state[p + "forget_gate.A_log"].view(1, 1, -1, 1)
    return "KimiLinearForCausalLM", kimi_config(c), state


def kimi_problems(c: Any, sd: dict[str, torch.Tensor]) -> list[str]:
    """What a Kimi Linear config c and its weights sd hold that our model cannot, each as the
    setting that says it."""
    hd = c.hidden_size // c.num_attention_heads
    sparse = [t for t in c.mlp_layer_types if t != "dense"]
    untied = not torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"])
    problems = {
        f"experts ({len(sparse)} layers of mlp_layer_types 'sparse')": bool(sparse),
        "an output head apart from the embeddings (lm_head.weight)": untied,
        f"hidden_act={c.hidden_act!r}": c.hidden_act != "silu",
        f"rms_norm_eps={c.rms_norm_eps}": c.rms_norm_eps != NORM_EPS,
        "attention_bias=True": c.attention_bias,
        f"qk_nope_head_dim={c.qk_nope_head_dim}, v_head_dim={c.v_head_dim} (ours: both {hd})": (
            c.qk_nope_head_dim != hd or c.v_head_dim != hd
        ),
        f"num_key_value_heads={c.num_key_value_heads}": c.num_key_value_heads
        != c.num_attention_heads,
    }
    kinds = kinds_of(c.layer_types, MODEL_TYPE, LAYER_TYPES)
    if kinds is None:
        problems[f"layer_types {sorted(set(c.layer_types))}"] = True
    else:
        for kind in dict.fromkeys(kinds):
            problems |= dict.fromkeys(kind.hf_problems(c), True)
    return [what for what, true in problems.items() if true]


def from_kimi_linear(
    folder: str, c: Any, sd: dict[str, torch.Tensor]
) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """Our config and weights from a Kimi Linear config c and its weights sd (kimi_linear's
    inverse); what our model cannot hold is refused in one line."""
    if bad := kimi_problems(c, sd):
        raise UserError(f"{folder}: this model cannot hold {', '.join(bad)}")
    kinds = kinds_of(c.layer_types, MODEL_TYPE, LAYER_TYPES)
    letters = "".join(kind.letter for kind in kinds)
    attending = any(kind.attends for kind in kinds)
    mla = dict(kv_lora_rank=c.kv_lora_rank, q_lora_rank=c.q_lora_rank)
    config = GPTConfig(
        **shape_of(c),
        bias=False,
        pos_encoding="rope",
        norm="rmsnorm",
        mlp="swiglu",
        **pattern_keys(letters, rotary=[False] * len(letters)),  # no positions anywhere
        **(mla | dict(qk_rope_head_dim=c.qk_rope_head_dim) if attending else {}),
    )
    sd = dict(sd)
    state = {
        "transformer.wte.weight": sd["model.embed_tokens.weight"],
        "transformer.ln_f.weight": sd["model.norm.weight"],
    }
    for i, kind in enumerate(kinds):
        ours = f"transformer.h.{i}."
        theirs = f"model.layers.{i}."
        p = theirs + "self_attn."
        if kind.attends:
            latent_rows(sd, p, config, 1 / LATENT_SCALE)
        else:
            qkv = [sd[p + f"{x}_proj.weight"] for x in "qkv"]
            state[ours + "attn.c_qkv.weight"] = torch.cat(qkv)
            sd[p + "forget_gate.A_log"] = sd[p + "forget_gate.A_log"].flatten()
        for a, b in layer_names(kind).items():
            if theirs + b in sd:
                state[ours + a] = sd[theirs + b]
    return config, state


def llama_cpp_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights of a saved KimiLinearForCausalLM folder (transformers saves them under the
    original checkpoint's names, which llama.cpp's converter reads, but a dense MLP under the
    experts' block_sparse_moe) with each dense MLP under mlp, as the original's dense layers."""
    return {name.replace(".block_sparse_moe.", ".mlp."): t for name, t in state.items()}


def llama_cpp_keys(c: GPTConfig) -> dict[str, Any]:
    """What llama.cpp's kimi_linear converter reads of a KimiLinearForCausalLM folder's config.json
    beyond what transformers writes: the original's linear_attn_config (layers 1-indexed), and the
    mixture-of-experts keys it reads whatever the MLPs, given values of no effect (every layer
    dense: first_k_dense_replace = n_layer)."""
    kinds = c.layer_kinds
    layer_keys = kinds_config(c)
    linear = {
        "full_attn_layers": [i + 1 for i, kind in enumerate(kinds) if kind.attends],
        "kda_layers": [i + 1 for i, kind in enumerate(kinds) if not kind.attends],
        "head_dim": layer_keys["linear_head_dim"],
        "num_heads": layer_keys["linear_num_heads"],
        "short_conv_kernel_size": layer_keys["linear_conv_kernel_dim"],
    }
    return dict(
        linear_attn_config=linear,
        first_k_dense_replace=c.n_layer,
        moe_intermediate_size=c.mlp_hidden,
        num_shared_experts=0,
        routed_scaling_factor=1.0,
        moe_router_activation_func="sigmoid",
    )
