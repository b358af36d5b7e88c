"""Llama's block (norm='rmsnorm', mlp='swiglu') as stock transformers classes: rotary MHA/GQA/MQA as
LlamaForCausalLM, with local layers (window) as GraniteSWAForCausalLM, MLA (kv_lora_rank) as a dense
DeepseekV3ForCausalLM. The weight mappings both ways, and what no class holds, refused in one line;
smallgpt/hf.py calls these (docs/export.md "Llama's block and MLA", "Local layers").
"""

import math
from typing import Any

import torch

from attention import NORM_EPS
from layer_kind import LayerKind
from model import LAYER_KINDS, GPTConfig
from model_config import pattern_keys
from smallgpt.errors import UserError

# a block's modules: ours -> Llama's (SwiGLU's gate, up and down are c_gate, c_fc and c_proj)
LLAMA_LAYER = {
    "attn.c_q": "self_attn.q_proj",
    "attn.c_k": "self_attn.k_proj",
    "attn.c_v": "self_attn.v_proj",
    "attn.c_proj": "self_attn.o_proj",
    "mlp.c_gate": "mlp.gate_proj",
    "mlp.c_fc": "mlp.up_proj",
    "mlp.c_proj": "mlp.down_proj",
    "ln_1": "input_layernorm",
    "ln_2": "post_attention_layernorm",
}
DEEPSEEK_LAYER = {k: v for k, v in LLAMA_LAYER.items() if k not in ("attn.c_k", "attn.c_v")} | {
    "attn.q_a": "self_attn.q_a_proj",
    "attn.q_norm": "self_attn.q_a_layernorm",
    "attn.q_b": "self_attn.q_b_proj",
    "attn.kv_a": "self_attn.kv_a_proj_with_mqa",
    "attn.kv_norm": "self_attn.kv_a_layernorm",
    "attn.kv_b": "self_attn.kv_b_proj",
}
MODEL_TYPES = ("llama", "deepseek_v3", "granite_swa")
# GraniteSWA's per-head attention sink: this logit beside the scores leaves their softmax as it is
# (exp(-1e4) is 0)
NO_SINK = -1e4
# transformers' DeepSeek attention normalises its latents (q_a_layernorm, kv_a_layernorm) with this
# epsilon whatever rms_norm_eps says, and ours with NORM_EPS. RMSNorm(a z, eps) =
# RMSNorm(z, eps / a**2), so the rows that make a latent are scaled by LATENT_SCALE on the way out
# and back on the way in: exact. llama.cpp uses rms_norm_eps there.
HF_LATENT_EPS = 1e-6
LATENT_SCALE = math.sqrt(HF_LATENT_EPS / NORM_EPS)


def llama_class(c: GPTConfig) -> str | None:
    """LlamaForCausalLM (GraniteSWAForCausalLM with local layers) or DeepseekV3ForCausalLM where c
    has Llama's block or MLA, None for GPT-2's block (smallgpt/hf.py's classes); a model no stock
    class holds exactly is refused in one line naming the keys that would make it one."""
    llama_block = (c.norm, c.mlp) == ("rmsnorm", "swiglu")
    windowed = c.window is not None
    granite = granite_keys(c)
    if c.kv_lora_rank is not None:
        needs = {
            "norm='rmsnorm' and mlp='swiglu'": not llama_block,
            "pos_encoding='rope'": c.pos_encoding != "rope",
            "bias=False": c.bias,
            "latent_norm=True": not c.latent_norm,
            "no window": windowed,
            "no sinks (attn_sinks)": c.attn_sinks,
            "rotary positions on every layer (rope_pattern='R')": bool(c.positionless_layers),
        }
        if missing := [key for key, needed in needs.items() if needed]:
            raise UserError(
                f"export needs {', '.join(missing)} for MLA (DeepseekV3ForCausalLM: Llama's block, "
                f"rotary positions, no biases, an RMSNorm on the latent)"
            )
        return "DeepseekV3ForCausalLM"
    if granite and not (llama_block and c.pos_encoding == "rope"):
        raise UserError(
            f"exporting {' and '.join(granite)} needs norm='rmsnorm', mlp='swiglu' and "
            "pos_encoding='rope' (GraniteSWAForCausalLM: Llama's block with per-layer sliding "
            "windows, sinks and rotary bases); no stock class holds them with "
            f"norm={c.norm!r}, mlp={c.mlp!r}, pos_encoding={c.pos_encoding!r}"
        )
    if (c.norm, c.mlp) == ("layernorm", "gelu"):
        return None
    if not llama_block:
        raise UserError(
            f"no stock transformers class holds norm={c.norm!r} with mlp={c.mlp!r}: export needs "
            "norm='rmsnorm' with mlp='swiglu' (LlamaForCausalLM) or norm='layernorm' with "
            "mlp='gelu' (Starcoder2ForCausalLM, GPT2LMHeadModel)"
        )
    if c.pos_encoding != "rope":
        raise UserError(
            "export needs pos_encoding='rope' for Llama's block (LlamaForCausalLM); learned "
            "positions export with norm='layernorm' and mlp='gelu' (GPT2LMHeadModel, "
            "GPTBigCodeForCausalLM)"
        )
    return "GraniteSWAForCausalLM" if granite else "LlamaForCausalLM"


def granite_keys(c: GPTConfig) -> list[str]:
    """What of c only GraniteSWA holds among the Llama-block classes, as the keys that set it:
    local layers, sinks, layers without positions."""
    keys = {
        "local layers (window)": c.window is not None,
        "sinks (attn_sinks)": c.attn_sinks,
        "layers without positions (rope_pattern's N)": bool(c.positionless_layers),
    }
    return [key for key, given in keys.items() if given]


def renamed(
    sd: dict[str, torch.Tensor], n_layer: int, layer: dict[str, str], prefixes: tuple[str, str]
) -> dict[str, torch.Tensor]:
    """sd's tensors under the other side's names: prefixes (ours, theirs) is ('transformer.',
    'model.') out and the reverse in; what sd lacks (a bias) is left out."""
    ours, theirs = prefixes
    names = {"wte.weight": "embed_tokens.weight", "ln_f.weight": "norm.weight"}
    names |= {
        f"h.{i}.{a}.{kind}": f"layers.{i}.{b}.{kind}"
        for i in range(n_layer)
        for a, b in layer.items()
        for kind in ("weight", "bias")
    }
    if ours != "transformer.":
        names = {b: a for a, b in names.items()}
    return {theirs + b: sd[ours + a] for a, b in names.items() if ours + a in sd}


def shape_config(c: GPTConfig) -> dict[str, Any]:
    """The fields every transformers decoder config names alike (Llama, DeepSeek-V3, Qwen3.5,
    Starcoder2): the model's sizes, its context and its tied embeddings."""
    return dict(
        vocab_size=c.vocab_size,
        hidden_size=c.n_embd,
        intermediate_size=c.mlp_hidden,
        num_hidden_layers=c.n_layer,
        num_attention_heads=c.n_head,
        max_position_embeddings=c.block_size,
        tie_word_embeddings=True,
    )


def kinds_config(c: GPTConfig) -> dict[str, Any]:
    """The keys of a transformers config that c's kinds of layer give (LayerKind.hf_config)."""
    kinds = dict.fromkeys(c.layer_kinds)
    return {key: value for kind in kinds for key, value in kind.hf_config(c).items()}


def kinds_of(
    layer_types: list[str], model_type: str, held: tuple[str, ...]
) -> list[type[LayerKind]] | None:
    """Each layer's kind by its transformers layer type in the class of model_type, which holds
    the layer types `held` (attention's kinds and the kinds whose hf_model it is); None where a
    type is no kind's there."""
    by_type = {
        kind.hf_layer_type: kind
        for kind in LAYER_KINDS.values()
        if kind.hf_model in (None, model_type) and kind.hf_layer_type in held
    }
    if not set(layer_types) <= set(by_type):
        return None
    return [by_type[t] for t in layer_types]


def shape_of(c: Any) -> dict[str, Any]:
    """shape_config's inverse: our sizes and context from such a transformers config."""
    return dict(
        block_size=c.max_position_embeddings,
        vocab_size=c.vocab_size,
        n_layer=c.num_hidden_layers,
        n_head=c.num_attention_heads,
        n_embd=c.hidden_size,
        mlp_hidden=c.intermediate_size,
    )


def rope_config(c: GPTConfig) -> dict[str, Any]:
    """The rotary base, as transformers 5 (rope_parameters) and 4.57 (rope_theta) read it."""
    return dict(
        rope_theta=c.rope_theta,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
    )


def llama(c: GPTConfig, sd: dict[str, torch.Tensor]) -> tuple[str, Any, dict[str, torch.Tensor]]:
    """Llama's config and weights. Its attention rotates halves of each head (rotate_half), as
    attention.apply_rope does, and query head h reads K/V head h // (n_head / n_kv_head), as SDPA's
    enable_gqa."""
    import transformers

    config = transformers.LlamaConfig(
        **shape_config(c),
        num_key_value_heads=c.n_kv_head,
        head_dim=c.head_dim,
        hidden_act="silu",
        rms_norm_eps=NORM_EPS,
        attention_bias=c.bias,
        mlp_bias=c.bias,
        bos_token_id=None,
        eos_token_id=None,
        **rope_config(c),
    )
    state = renamed(sd, c.n_layer, LLAMA_LAYER, ("transformer.", "model."))
    return "LlamaForCausalLM", config, state


def granite_swa(
    c: GPTConfig, sd: dict[str, torch.Tensor]
) -> tuple[str, Any, dict[str, torch.Tensor]]:
    """Local layers, sinks or layers without positions: IBM's GraniteSWA, Llama's layers with a
    sliding window in those layer_types names (a query sees itself and window - 1 before it, as
    ours), its multipliers at Llama's (scores scaled by head_dim ** -0.5, the others 1), each
    head's sink (ours where attn_sinks is set, else NO_SINK) and a rotary base a layer, 0 where a
    layer has none (NoPE). llama.cpp's granite_swa reads the same pattern."""
    import transformers

    _, llama_config, state = llama(c, sd)
    not_granite = ("head_dim", "model_type", "architectures")
    keys = {k: v for k, v in llama_config.to_dict().items() if k not in not_granite}
    layer_types = [kind.hf_layer_type for kind in c.layer_kinds]
    keys |= dict(
        attention_multiplier=c.head_dim**-0.5,
        # no layer slides without a window, but transformers builds a sliding mask all the same
        sliding_window=c.window or c.block_size,
        layer_types=layer_types,
        layer_rope_theta=[c.rope_theta if layer.rotary else 0 for layer in c.layers],
        # the same as llama.cpp's converter reads it: 1 where a layer rotates, 0 where not
        no_rope_layers=[int(layer.rotary) for layer in c.layers],
    )
    config = transformers.GraniteSWAConfig(**keys)
    for i in range(c.n_layer):
        sinks = sd.get(f"transformer.h.{i}.attn.sinks", torch.full((c.n_head,), NO_SINK))
        state[f"model.layers.{i}.self_attn.sinks"] = sinks
    return "GraniteSWAForCausalLM", config, state


def deepseek(
    c: GPTConfig, sd: dict[str, torch.Tensor], llama_cpp: bool = False
) -> tuple[str, Any, dict[str, torch.Tensor]]:
    """MLA: DeepSeek-V3's config, dense (first_k_dense_replace = n_layer: every MLP is Llama's, no
    expert is built), and weights. Each head's query is [nope | rope] and kv_b's rows each head's [k
    | v], as ours. llama_cpp: the folder llama.cpp's converter reads, whose deepseek2 rotates pairs
    (rope_interleave=True, the rotary rows permuted to match) and normalises the latents with
    rms_norm_eps (so they are not rescaled)."""
    import transformers

    config = transformers.DeepseekV3Config(
        **shape_config(c),
        num_key_value_heads=c.n_head,
        hidden_act="silu",
        rms_norm_eps=NORM_EPS,
        attention_bias=False,
        kv_lora_rank=c.kv_lora_rank,
        q_lora_rank=c.q_lora_rank,
        qk_rope_head_dim=c.qk_rope_head_dim,
        qk_nope_head_dim=c.head_dim,
        v_head_dim=c.head_dim,
        rope_interleave=llama_cpp,
        first_k_dense_replace=c.n_layer,
        n_routed_experts=0,
        n_shared_experts=0,
        num_experts_per_tok=None,
        n_group=None,
        topk_group=None,
        moe_intermediate_size=c.mlp_hidden,
        num_mtp_layers=0,
        bos_token_id=None,
        eos_token_id=None,
        **rope_config(c),
    )
    state = renamed(sd, c.n_layer, DEEPSEEK_LAYER, ("transformer.", "model."))
    for i in range(c.n_layer):
        p = f"model.layers.{i}.self_attn."
        if llama_cpp:
            pairs(state, p, c, to_pairs=True)
        else:
            latent_rows(state, p, c, LATENT_SCALE)
    return "DeepseekV3ForCausalLM", config, state


def latent_rows(state: dict[str, torch.Tensor], p: str, c: GPTConfig, scale: float) -> None:
    """The rows of q_a and kv_a that make the latents, times scale (see LATENT_SCALE); they have no
    biases."""
    kv_a = state[p + "kv_a_proj_with_mqa.weight"].clone()
    kv_a[: c.kv_lora_rank] *= scale
    state[p + "kv_a_proj_with_mqa.weight"] = kv_a
    if c.q_lora_rank is not None:
        state[p + "q_a_proj.weight"] = state[p + "q_a_proj.weight"] * scale


def pairs(state: dict[str, torch.Tensor], p: str, c: GPTConfig, to_pairs: bool) -> None:
    """The rotary rows of the queries (each head's last qk_rope_head_dim) and of the shared key
    (kv_a's last) from halves (x1 | x2, feature i rotated with i + dim/2) to pairs (x1[0], x2[0],
    x1[1], ...) or, to_pairs=False, back."""
    rope = c.qk_rope_head_dim

    def reorder(rows: torch.Tensor) -> torch.Tensor:  # (..., rope, in)
        shape = (2, rope // 2) if to_pairs else (rope // 2, 2)
        return rows.unflatten(-2, shape).transpose(-3, -2).flatten(-3, -2)

    q_name = p + ("q_proj.weight" if c.q_lora_rank is None else "q_b_proj.weight")
    q = state[q_name].unflatten(0, (c.n_head, -1))  # (n_head, head_dim + rope, in)
    state[q_name] = torch.cat((q[:, :-rope], reorder(q[:, -rope:])), dim=1).flatten(0, 1)
    kv_a = state[p + "kv_a_proj_with_mqa.weight"]
    state[p + "kv_a_proj_with_mqa.weight"] = torch.cat((kv_a[:-rope], reorder(kv_a[-rope:])))


def from_llama_block(
    folder: str, c: Any, sd: dict[str, torch.Tensor]
) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """Our config and weights from a Llama, GraniteSWA or DeepSeek-V3 transformers config c and its
    weights sd; what this model cannot hold (untied embeddings, another epsilon, activation or rope
    type, experts, ...) is refused in one line."""
    if bad := llama_block_problems(c, sd):
        raise UserError(f"{folder}: this model cannot hold {', '.join(bad)}")
    rope = c.rope_parameters or {}
    common = shape_of(c) | dict(
        pos_encoding="rope",
        rope_theta=float(rope["rope_theta"]),
        norm="rmsnorm",
        mlp="swiglu",
    )
    if c.model_type == "deepseek_v3":
        return from_deepseek(c, sd, common)
    n_kv_head = c.num_key_value_heads
    local = granite_windows(c) | granite_sinks(c, sd)
    config = GPTConfig(n_kv_head=n_kv_head, bias=c.attention_bias, **(common | local))
    state = renamed(sd, config.n_layer, LLAMA_LAYER, ("model.", "transformer."))
    if config.attn_sinks:
        for i in range(config.n_layer):
            state[f"transformer.h.{i}.attn.sinks"] = sd[f"model.layers.{i}.self_attn.sinks"]
    return config, state


def from_deepseek(
    c: Any, sd: dict[str, torch.Tensor], common: dict[str, Any]
) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """MLA from a DeepSeek-V3 config c (common: the keys every Llama block gives) and its weights
    sd: deepseek's inverse, the latents' rows scaled back and the rotary rows back to halves."""
    config = GPTConfig(
        bias=False,
        kv_lora_rank=c.kv_lora_rank,
        qk_rope_head_dim=c.qk_rope_head_dim,
        q_lora_rank=c.q_lora_rank,
        **common,
    )
    sd = dict(sd)
    for i in range(config.n_layer):
        p = f"model.layers.{i}.self_attn."
        latent_rows(sd, p, config, 1 / LATENT_SCALE)
        if c.rope_interleave:
            pairs(sd, p, config, to_pairs=False)
    return config, renamed(sd, config.n_layer, DEEPSEEK_LAYER, ("model.", "transformer."))


def granite_windows(c: Any) -> dict[str, Any]:
    """GraniteSWA's sliding layers as our window and window_pattern: {} for none, or another
    model."""
    if c.model_type != "granite_swa":
        return {}
    if "sliding_attention" not in c.layer_types:
        return {}
    # each layer's letter by its transformers layer type, as the kinds declare it
    letters = {kind.hf_layer_type: letter for letter, kind in LAYER_KINDS.items()}
    pattern = "".join(letters[t] for t in c.layer_types)
    return dict(window=c.sliding_window, **pattern_keys(pattern))


def granite_sinks(c: Any, sd: dict[str, torch.Tensor]) -> dict[str, Any]:
    """GraniteSWA's sinks and rotary bases as our attn_sinks and rope_pattern: sinks where any
    head's sink is above NO_SINK (a pinned one leaves the softmax as it is), N on a layer of base
    0; {} for a Llama."""
    if c.model_type != "granite_swa":
        return {}
    sinks = [t for name, t in sd.items() if name.endswith(".sinks")]
    keys: dict[str, Any] = {}
    if any(float(t.max()) > NO_SINK for t in sinks):
        keys["attn_sinks"] = True
    if thetas := {theta for theta in c.layer_rope_theta if theta}:
        keys["rope_theta"] = float(thetas.pop())  # one base (llama_block_problems)
    # rope_pattern where some layer's base is 0 (no positions)
    keys |= pattern_keys("L", rotary=[theta != 0 for theta in c.layer_rope_theta])
    return keys


def llama_block_problems(c: Any, sd: dict[str, torch.Tensor]) -> list[str]:
    """What a Llama, GraniteSWA or DeepSeek-V3 config c and its weights sd hold that this model
    cannot, each as the setting that says it."""
    rope = c.rope_parameters or {}
    head_dim = c.hidden_size // c.num_attention_heads
    rope_type = rope.get("rope_type", "default")
    partial = rope.get("partial_rotary_factor", 1)
    problems = {
        f"tie_word_embeddings={c.tie_word_embeddings}": not c.tie_word_embeddings,
        f"hidden_act={c.hidden_act!r}": c.hidden_act != "silu",
        f"rms_norm_eps={c.rms_norm_eps}": c.rms_norm_eps != NORM_EPS,
        f"rope_type={rope.get('rope_type')!r}": rope_type != "default",
        f"partial_rotary_factor={rope.get('partial_rotary_factor')}": partial != 1,
    }
    if c.model_type == "deepseek_v3":
        problems |= deepseek_problems(c, head_dim)
    else:
        problems |= llama_problems(c, head_dim)
    if c.model_type == "granite_swa":
        problems |= granite_problems(c, sd, head_dim)
    return [what for what, true in problems.items() if true]


def deepseek_problems(c: Any, head_dim: int) -> dict[str, bool]:
    """Each thing a DeepSeek-V3 config may hold that this model's MLA cannot, and whether c holds
    it; head_dim: hidden_size / num_attention_heads."""
    experts = (
        f"experts (first_k_dense_replace={c.first_k_dense_replace} < "
        f"num_hidden_layers={c.num_hidden_layers})"
    )
    head_dims = (
        f"qk_nope_head_dim={c.qk_nope_head_dim}, v_head_dim={c.v_head_dim} (ours: both "
        f"hidden_size / num_attention_heads = {head_dim})"
    )
    same_dims = c.qk_nope_head_dim == c.v_head_dim == head_dim
    grouped = c.num_key_value_heads != c.num_attention_heads
    return {
        experts: c.first_k_dense_replace < c.num_hidden_layers,
        "attention_bias=True": c.attention_bias,
        head_dims: not same_dims,
        f"num_key_value_heads={c.num_key_value_heads}": grouped,
    }


def llama_problems(c: Any, head_dim: int) -> dict[str, bool]:
    """Each thing a Llama (or GraniteSWA) config may hold that this model cannot, and whether c
    holds it; head_dim: hidden_size / num_attention_heads."""
    given = getattr(c, "head_dim", head_dim)
    biases = f"attention_bias={c.attention_bias} with mlp_bias={c.mlp_bias}"
    head_dims = f"head_dim={given} (ours: hidden_size / num_attention_heads = {head_dim})"
    return {
        biases: c.attention_bias != c.mlp_bias,
        head_dims: given != head_dim,
    }


def granite_problems(c: Any, sd: dict[str, torch.Tensor], head_dim: int) -> dict[str, bool]:
    """Each thing a GraniteSWA config and its weights may hold that this model cannot (granite_swa's
    inverse), and whether this folder holds it."""
    attention = f"attention_multiplier={c.attention_multiplier} (ours: head_dim ** -0.5)"
    scaled = not math.isclose(c.attention_multiplier, head_dim**-0.5, rel_tol=1e-6)
    multipliers = (
        f"embedding_multiplier={c.embedding_multiplier}, "
        f"residual_multiplier={c.residual_multiplier}, "
        f"logits_scaling={c.logits_scaling} (ours: 1)"
    )
    others = (c.embedding_multiplier, c.residual_multiplier, c.logits_scaling)
    last = c.layer_types[-1]
    last_layer = f"layer_types ending in {last!r} (our last layer is always global)"
    return {
        attention: scaled,
        multipliers: others != (1, 1, 1),
        last_layer: last != "full_attention",
        "a rope base per layer": len({theta for theta in c.layer_rope_theta if theta}) > 1,
    }
