"""Gated DeltaNet hybrids and Qwen3.5's attention (an output gate, q/k norms, a rotary fraction) as
transformers' dense Qwen3_5ForCausalLM, both ways; what the class cannot hold is refused in one line
before anything is written (docs/export.md "Gated DeltaNet hybrids"). smallgpt/hf.py calls these.

The class differs from ours in three ways, each matched by construction: its RMSNorms (but the
Gated DeltaNet's output norm) scale by 1 + w, so w - 1 goes out and w + 1 comes in; its q_proj
holds each head's query then its gate, side by side; its layer_types list names every layer.
"""

from typing import Any

import torch

from attention import NORM_EPS
from layer_kind import LayerKind
from model import GPTConfig
from model_config import pattern_keys
from smallgpt.errors import UserError
from smallgpt.hf_llama import (
    LLAMA_LAYER,
    kinds_config,
    kinds_of,
    shape_config,
    shape_of,
)

MODEL_TYPE = "qwen3_5_text"
# the layer types Qwen3.5's class holds (each kind's hf_layer_type names its own)
LAYER_TYPES = ("full_attention", "linear_attention")
# every block's, ours -> Qwen3.5's (Llama's norms and MLP); its norms scale by 1 + w
BLOCK = {f"{a}.weight": f"{b}.weight" for a, b in LLAMA_LAYER.items() if not a.startswith("attn.")}
ONE_PLUS_W = ("ln_1.weight", "ln_2.weight", "attn.q_norm.weight", "attn.k_norm.weight")


def wants_qwen(c: GPTConfig) -> bool:
    """Whether c has what only Qwen3.5's class holds: Gated DeltaNet layers, or its attention."""
    qwen_attention = c.attn_gate != "none" or c.qk_norm or c.rope_fraction != 1
    return any(kind.hf_model == MODEL_TYPE for kind in c.layer_kinds) or qwen_attention


def check_qwen(c: GPTConfig) -> None:
    """A UserError naming every key Qwen3_5ForCausalLM needs that c lacks."""
    attending = len(c.recurrent_layers) < c.n_layer
    needs = {
        "norm='rmsnorm' and mlp='swiglu'": (c.norm, c.mlp) != ("rmsnorm", "swiglu"),
        "pos_encoding='rope'": c.pos_encoding != "rope",
        "bias=False": c.bias,
        "no MLA (kv_lora_rank)": c.attention_type == "MLA",
        "no local layers (window)": c.window is not None,
        "no sinks (attn_sinks)": c.attn_sinks,
        "rotary positions on every layer (rope_pattern='R')": bool(c.positionless_layers),
        "attn_gate='element'": attending and c.attn_gate != "element",
        "qk_norm=True": attending and not c.qk_norm,
        # transformers' Qwen3.5 cache reads its length from an attention layer
        "an attention layer (L in layer_pattern)": not attending,
    }
    if missing := [key for key, needed in needs.items() if needed]:
        raise UserError(
            f"export needs {', '.join(missing)} for Gated DeltaNet layers or Qwen3.5's attention "
            "(Qwen3_5ForCausalLM: Llama's block, rotary positions, no biases, every attention "
            "layer global with its output gated per feature and q/k normed)"
        )


def qwen_config(c: GPTConfig) -> Any:
    """Qwen3_5TextConfig of c: its Gated DeltaNet heads are c's heads, keys as wide as values."""
    from transformers import Qwen3_5TextConfig

    layer_keys = kinds_config(c)
    return Qwen3_5TextConfig(
        **shape_config(c),
        num_key_value_heads=c.n_kv_head,
        head_dim=c.head_dim,
        hidden_act="silu",
        rms_norm_eps=NORM_EPS,
        attention_bias=False,
        **layer_keys,
        layer_types=[kind.hf_layer_type for kind in c.layer_kinds],
        rope_parameters={
            "rope_type": "default",
            "rope_theta": c.rope_theta,
            "partial_rotary_factor": c.rope_fraction,
        },
    )


def qwen35(c: GPTConfig, sd: dict[str, torch.Tensor]) -> tuple[str, Any, dict[str, torch.Tensor]]:
    """Qwen3.5's config and weights (hf.target_class has checked that the class holds c)."""
    state = {
        "model.embed_tokens.weight": sd["transformer.wte.weight"],
        "model.norm.weight": sd["transformer.ln_f.weight"] - 1,
    }
    for i, kind in enumerate(c.layer_kinds):
        ours = f"transformer.h.{i}."
        theirs = f"model.layers.{i}."
        if kind.attends:
            state[theirs + "self_attn.q_proj.weight"] = query_and_gate(c, sd, ours)
        for a, b in layer_names(kind).items():
            state[theirs + b] = sd[ours + a] - (1 if a in ONE_PLUS_W else 0)
    return "Qwen3_5ForCausalLM", qwen_config(c), state


def layer_names(kind: type[LayerKind]) -> dict[str, str]:
    """A layer's parameters, ours -> Qwen3.5's, but q_proj (query_and_gate): its kind's, and the
    block's."""
    return BLOCK | {f"attn.{a}": b for a, b in kind.hf_names.items()}


def query_and_gate(c: GPTConfig, sd: dict[str, torch.Tensor], layer: str) -> torch.Tensor:
    """q_proj's rows: each head's query rows, then its gate rows."""
    q = sd[layer + "attn.c_q.weight"].view(c.n_head, 1, c.head_dim, c.n_embd)
    gate = sd[layer + "attn.gate.c_gate.weight"].view(c.n_head, 1, c.head_dim, c.n_embd)
    return torch.cat((q, gate), dim=1).reshape(2 * c.n_embd, c.n_embd)


def qwen_problems(c: Any) -> list[str]:
    """What a Qwen3.5 config holds that our model cannot, each as the setting that says it."""
    rope = c.rope_parameters or {}
    hd = c.hidden_size // c.num_attention_heads
    problems = {
        f"tie_word_embeddings={c.tie_word_embeddings}": not c.tie_word_embeddings,
        f"hidden_act={c.hidden_act!r}": c.hidden_act != "silu",
        f"rms_norm_eps={c.rms_norm_eps}": c.rms_norm_eps != NORM_EPS,
        f"rope_type={rope.get('rope_type')!r}": rope.get("rope_type", "default") != "default",
        "attention_bias=True": c.attention_bias,
        f"head_dim={c.head_dim} (not hidden_size / num_attention_heads = {hd})": c.head_dim != hd,
    }
    kinds = kinds_of(c.layer_types, MODEL_TYPE, LAYER_TYPES)
    if kinds is None:
        problems[f"layer_types {sorted(set(c.layer_types))}"] = True
    else:
        for kind in dict.fromkeys(kinds):
            problems |= dict.fromkeys(kind.hf_problems(c), True)
    return [what for what, true in problems.items() if true]


def from_qwen35(
    folder: str, c: Any, sd: dict[str, torch.Tensor]
) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """Our config and weights from a Qwen3.5 text config c and its weights sd (qwen35's inverse);
    what our model cannot hold is refused in one line."""
    if bad := qwen_problems(c):
        raise UserError(f"{folder}: this model cannot hold {', '.join(bad)}")
    kinds = kinds_of(c.layer_types, MODEL_TYPE, LAYER_TYPES)
    letters = "".join(kind.letter for kind in kinds)
    attending = any(kind.attends for kind in kinds)
    rope = c.rope_parameters
    config = GPTConfig(
        **shape_of(c),
        n_kv_head=c.num_key_value_heads,
        bias=False,
        pos_encoding="rope",
        rope_theta=float(rope["rope_theta"]),
        rope_fraction=float(rope.get("partial_rotary_factor", 1.0)),
        norm="rmsnorm",
        mlp="swiglu",
        **pattern_keys(letters),
        attn_gate="element" if attending else "none",
        qk_norm=attending,
    )
    state = {
        "transformer.wte.weight": sd["model.embed_tokens.weight"],
        "transformer.ln_f.weight": sd["model.norm.weight"] + 1,
    }
    for i, kind in enumerate(kinds):
        ours = f"transformer.h.{i}."
        theirs = f"model.layers.{i}."
        if kind.attends:
            q_proj = sd[theirs + "self_attn.q_proj.weight"].view(c.num_attention_heads, 2, -1)
            q, gate = q_proj.unbind(1)
            state[ours + "attn.c_q.weight"] = q.reshape(-1, c.hidden_size)
            state[ours + "attn.gate.c_gate.weight"] = gate.reshape(-1, c.hidden_size)
        for a, b in layer_names(kind).items():
            state[ours + a] = sd[theirs + b] + (1 if a in ONE_PLUS_W else 0)
    return config, state
