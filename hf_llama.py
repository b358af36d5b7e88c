"""Llama's block (norm='rmsnorm', mlp='swiglu') as stock transformers classes: rotary MHA/GQA/MQA as LlamaForCausalLM,
MLA (kv_lora_rank) as a dense DeepseekV3ForCausalLM. The weight mappings both ways, and what neither class holds,
refused in one line; hf.py calls these (docs/export.md "Llama's block and MLA").
"""

import math
from typing import Any

import torch

from attention import NORM_EPS
from errors import UserError
from model import GPTConfig

# a block's modules: ours -> Llama's (SwiGLU's gate, up and down are c_gate, c_fc and c_proj)
LLAMA_LAYER = {"attn.c_q": "self_attn.q_proj", "attn.c_k": "self_attn.k_proj", "attn.c_v": "self_attn.v_proj",
               "attn.c_proj": "self_attn.o_proj", "mlp.c_gate": "mlp.gate_proj", "mlp.c_fc": "mlp.up_proj",
               "mlp.c_proj": "mlp.down_proj", "ln_1": "input_layernorm", "ln_2": "post_attention_layernorm"}
DEEPSEEK_LAYER = {k: v for k, v in LLAMA_LAYER.items() if k not in ("attn.c_k", "attn.c_v")} | {
    "attn.q_a": "self_attn.q_a_proj", "attn.q_norm": "self_attn.q_a_layernorm", "attn.q_b": "self_attn.q_b_proj",
    "attn.kv_a": "self_attn.kv_a_proj_with_mqa", "attn.kv_norm": "self_attn.kv_a_layernorm",
    "attn.kv_b": "self_attn.kv_b_proj"}
MODEL_TYPES = ("llama", "deepseek_v3")
# transformers' DeepSeek attention normalises its latents (q_a_layernorm, kv_a_layernorm) with this epsilon whatever
# rms_norm_eps says, and ours with NORM_EPS. RMSNorm(a z, eps) = RMSNorm(z, eps / a**2), so the rows that make a latent
# are scaled by LATENT_SCALE on the way out and back on the way in: exact. llama.cpp uses rms_norm_eps there.
HF_LATENT_EPS = 1e-6
LATENT_SCALE = math.sqrt(HF_LATENT_EPS / NORM_EPS)


def llama_class(c: GPTConfig) -> str | None:
    """LlamaForCausalLM or DeepseekV3ForCausalLM where c has Llama's block or MLA, None for GPT-2's block (hf.py's
    classes); a model no stock class holds exactly is refused in one line naming the keys that would make it one."""
    llama_block = (c.norm, c.mlp) == ("rmsnorm", "swiglu")
    if c.kv_lora_rank is not None:
        needs = {"norm='rmsnorm' and mlp='swiglu'": not llama_block, "pos_encoding='rope'": c.pos_encoding != "rope",
                 "bias=False": c.bias, "latent_norm=True": not c.latent_norm}
        if missing := [key for key, needed in needs.items() if needed]:
            raise UserError(f"export needs {', '.join(missing)} for MLA (DeepseekV3ForCausalLM: Llama's block, "
                            f"rotary positions, no biases, an RMSNorm on the latent)")
        return "DeepseekV3ForCausalLM"
    if (c.norm, c.mlp) == ("layernorm", "gelu"):
        return None
    if not llama_block:
        raise UserError(f"no stock transformers class holds norm={c.norm!r} with mlp={c.mlp!r}: export needs "
                        f"norm='rmsnorm' with mlp='swiglu' (LlamaForCausalLM) or norm='layernorm' with mlp='gelu' "
                        f"(Starcoder2ForCausalLM, GPT2LMHeadModel)")
    if c.pos_encoding != "rope":
        raise UserError("export needs pos_encoding='rope' for Llama's block (LlamaForCausalLM); learned positions "
                        "export with norm='layernorm' and mlp='gelu' (GPT2LMHeadModel, GPTBigCodeForCausalLM)")
    return "LlamaForCausalLM"


def renamed(sd: dict[str, torch.Tensor], n_layer: int, layer: dict[str, str], prefixes: tuple[str, str]
            ) -> dict[str, torch.Tensor]:
    """sd's tensors under the other side's names: prefixes (ours, theirs) is ('transformer.', 'model.') out and
    the reverse in; what sd lacks (a bias) is left out."""
    ours, theirs = prefixes
    names = {"wte.weight": "embed_tokens.weight", "ln_f.weight": "norm.weight"}
    names |= {f"h.{i}.{a}.{kind}": f"layers.{i}.{b}.{kind}" for i in range(n_layer) for a, b in layer.items()
              for kind in ("weight", "bias")}
    if ours != "transformer.":
        names = {b: a for a, b in names.items()}
    return {theirs + b: sd[ours + a] for a, b in names.items() if ours + a in sd}


def rope_config(c: GPTConfig) -> dict[str, Any]:
    """The rotary base, as transformers 5 (rope_parameters) and 4.57 (rope_theta) read it."""
    return dict(rope_theta=c.rope_theta, rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta})


def llama(c: GPTConfig, sd: dict[str, torch.Tensor]) -> tuple[str, Any, dict[str, torch.Tensor]]:
    """Llama's config and weights. Its attention rotates halves of each head (rotate_half), as attention.apply_rope
    does, and query head h reads K/V head h // (n_head / n_kv_head), as SDPA's enable_gqa."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=c.mlp_hidden, num_hidden_layers=c.n_layer,
        num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head, head_dim=c.head_dim, hidden_act="silu",
        max_position_embeddings=c.block_size, rms_norm_eps=NORM_EPS, attention_bias=c.bias, mlp_bias=c.bias,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, **rope_config(c))
    return "LlamaForCausalLM", config, renamed(sd, c.n_layer, LLAMA_LAYER, ("transformer.", "model."))


def deepseek(c: GPTConfig, sd: dict[str, torch.Tensor], llama_cpp: bool = False
             ) -> tuple[str, Any, dict[str, torch.Tensor]]:
    """MLA: DeepSeek-V3's config, dense (first_k_dense_replace = n_layer: every MLP is Llama's, no expert is built),
    and weights. Each head's query is [nope | rope] and kv_b's rows each head's [k | v], as ours. llama_cpp: the folder
    llama.cpp's converter reads, whose deepseek2 rotates pairs (rope_interleave=True, the rotary rows permuted to
    match) and normalises the latents with rms_norm_eps (so they are not rescaled)."""
    import transformers

    config = transformers.DeepseekV3Config(
        vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=c.mlp_hidden, num_hidden_layers=c.n_layer,
        num_attention_heads=c.n_head, num_key_value_heads=c.n_head, hidden_act="silu",
        max_position_embeddings=c.block_size, rms_norm_eps=NORM_EPS, attention_bias=False, tie_word_embeddings=True,
        kv_lora_rank=c.kv_lora_rank, q_lora_rank=c.q_lora_rank, qk_rope_head_dim=c.qk_rope_head_dim,
        qk_nope_head_dim=c.head_dim, v_head_dim=c.head_dim, rope_interleave=llama_cpp, first_k_dense_replace=c.n_layer,
        n_routed_experts=0, n_shared_experts=0, num_experts_per_tok=None, n_group=None, topk_group=None,
        moe_intermediate_size=c.mlp_hidden, num_mtp_layers=0, bos_token_id=None, eos_token_id=None, **rope_config(c))
    state = renamed(sd, c.n_layer, DEEPSEEK_LAYER, ("transformer.", "model."))
    for i in range(c.n_layer):
        p = f"model.layers.{i}.self_attn."
        if llama_cpp:
            pairs(state, p, c, to_pairs=True)
        else:
            latent_rows(state, p, c, LATENT_SCALE)
    return "DeepseekV3ForCausalLM", config, state


def latent_rows(state: dict[str, torch.Tensor], p: str, c: GPTConfig, scale: float) -> None:
    """The rows of q_a and kv_a that make the latents, times scale (see LATENT_SCALE); they have no biases."""
    kv_a = state[p + "kv_a_proj_with_mqa.weight"].clone()
    kv_a[:c.kv_lora_rank] *= scale
    state[p + "kv_a_proj_with_mqa.weight"] = kv_a
    if c.q_lora_rank is not None:
        state[p + "q_a_proj.weight"] = state[p + "q_a_proj.weight"] * scale


def pairs(state: dict[str, torch.Tensor], p: str, c: GPTConfig, to_pairs: bool) -> None:
    """The rotary rows of the queries (each head's last qk_rope_head_dim) and of the shared key (kv_a's last) from
    halves (x1 | x2, feature i rotated with i + dim/2) to pairs (x1[0], x2[0], x1[1], ...) or, to_pairs=False, back."""
    rope = c.qk_rope_head_dim

    def reorder(rows: torch.Tensor) -> torch.Tensor:  # (..., rope, in)
        shape = (2, rope // 2) if to_pairs else (rope // 2, 2)
        return rows.unflatten(-2, shape).transpose(-3, -2).flatten(-3, -2)

    q_name = p + ("q_proj.weight" if c.q_lora_rank is None else "q_b_proj.weight")
    q = state[q_name].unflatten(0, (c.n_head, -1))  # (n_head, head_dim + rope, in)
    state[q_name] = torch.cat((q[:, :-rope], reorder(q[:, -rope:])), dim=1).flatten(0, 1)
    kv_a = state[p + "kv_a_proj_with_mqa.weight"]
    state[p + "kv_a_proj_with_mqa.weight"] = torch.cat((kv_a[:-rope], reorder(kv_a[-rope:])))


def from_llama_block(folder: str, c: Any, sd: dict[str, torch.Tensor]) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """Our config and weights from a Llama or DeepSeek-V3 transformers config c and its weights sd; what this model
    cannot hold (untied embeddings, another epsilon, activation or rope type, experts, ...) is refused in one line."""
    mla = c.model_type == "deepseek_v3"
    rope = c.rope_parameters or {}
    head_dim = c.hidden_size // c.num_attention_heads
    problems = {f"tie_word_embeddings={c.tie_word_embeddings}": not c.tie_word_embeddings,
                f"hidden_act={c.hidden_act!r}": c.hidden_act != "silu",
                f"rms_norm_eps={c.rms_norm_eps}": c.rms_norm_eps != NORM_EPS,
                f"rope_type={rope.get('rope_type')!r}": rope.get("rope_type", "default") != "default",
                f"partial_rotary_factor={rope.get('partial_rotary_factor')}": rope.get("partial_rotary_factor", 1) != 1}
    if mla:
        problems |= {f"experts (first_k_dense_replace={c.first_k_dense_replace} < num_hidden_layers="
                     f"{c.num_hidden_layers})": c.first_k_dense_replace < c.num_hidden_layers,
                     "attention_bias=True": c.attention_bias,
                     f"qk_nope_head_dim={c.qk_nope_head_dim}, v_head_dim={c.v_head_dim} (ours: both hidden_size / "
                     f"num_attention_heads = {head_dim})": not c.qk_nope_head_dim == c.v_head_dim == head_dim,
                     f"num_key_value_heads={c.num_key_value_heads}": c.num_key_value_heads != c.num_attention_heads}
    else:
        problems |= {f"attention_bias={c.attention_bias} with mlp_bias={c.mlp_bias}": c.attention_bias != c.mlp_bias,
                     f"head_dim={c.head_dim} (ours: hidden_size / num_attention_heads = {head_dim})":
                         c.head_dim != head_dim}
    if bad := [what for what, true in problems.items() if true]:
        raise UserError(f"{folder}: this model cannot hold {', '.join(bad)}")
    common = dict(block_size=c.max_position_embeddings, vocab_size=c.vocab_size, n_layer=c.num_hidden_layers,
                  n_head=c.num_attention_heads, n_embd=c.hidden_size, pos_encoding="rope",
                  rope_theta=float(rope["rope_theta"]), norm="rmsnorm", mlp="swiglu", mlp_hidden=c.intermediate_size)
    if not mla:
        config = GPTConfig(n_kv_head=c.num_key_value_heads, bias=c.attention_bias, **common)
        return config, renamed(sd, config.n_layer, LLAMA_LAYER, ("model.", "transformer."))
    config = GPTConfig(bias=False, kv_lora_rank=c.kv_lora_rank, qk_rope_head_dim=c.qk_rope_head_dim,
                       q_lora_rank=c.q_lora_rank, **common)
    sd = dict(sd)
    for i in range(config.n_layer):
        p = f"model.layers.{i}.self_attn."
        latent_rows(sd, p, config, 1 / LATENT_SCALE)
        if c.rope_interleave:
            pairs(sd, p, config, to_pairs=False)
    return config, renamed(sd, config.n_layer, DEEPSEEK_LAYER, ("model.", "transformer."))
