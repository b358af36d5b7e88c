"""Multi-head Latent Attention (attention.LatentAttention) and the Llama block: the latent cache
against recomputation, the absorbed one-token step against the unabsorbed one, the cache's bytes and
the parameter count against their formulas, every decoding path (padding, chunks, the window past
block_size, the static step; the compiled CPU step: test_generate's
test_compiled_cpu_step_decodes_the_eager_tokens_past_block_size)."""

import pytest
import torch
from test_generate import rows_as_by_hand

from attention import LatentAttention
from conftest import (
    cached_chunks_match,
    config_error,
    distinct,
    first_and_last_loss,
    padded_steps_match,
    static_steps_match,
    tiny_model,
)
from model import GPT, GPTConfig

ATOL = 1e-5  # float32: the cached (absorbed) and recomputed paths differ in summation order only
# two ranks, with and without the queries' own latent, rotary and learned positions (no rotary key)
CASES = {
    "r8-rope": dict(kv_lora_rank=8, pos_encoding="rope"),
    "r24-rope-q16": dict(kv_lora_rank=24, q_lora_rank=16, pos_encoding="rope", qk_rope_head_dim=4),
    "r12-learned": dict(kv_lora_rank=12, pos_encoding="learned"),
}


def mla(case: str, **overrides: object) -> GPT:
    """A tiny MLA model (4 heads of 8) with sharp attention: queries and the latent scaled up, so
    that which keys a query sees changes its output (a random model at initialisation hardly depends
    on its context)."""
    torch.manual_seed(0)
    m = tiny_model(None, **CASES[case] | overrides)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 2 and not name.startswith(("transformer.wte", "transformer.wpe")):
                p.mul_(20.0 if name.endswith(("c_q.weight", "q_b.weight", "kv_a.weight")) else 5.0)
    return m


def last(m: GPT, idx: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
    return m(idx, pad=pad)[0][:, -1]


@pytest.mark.parametrize("case", CASES)
def test_prefill_chunks_and_one_token_steps_from_the_latent_cache_equal_recomputation(
    case: str,
) -> None:
    m = mla(case)
    idx = cached_chunks_match(m, ATOL)
    other = idx.clone()
    other[:, 0] = (idx[:, 0] + 1) % 61
    assert (
        last(m, other) - last(m, idx)
    ).abs().max() > 1000 * ATOL  # the first token reaches the last position


@pytest.mark.parametrize("case", CASES)
def test_a_ragged_batch_from_the_latent_cache_equals_each_prompt_alone(case: str) -> None:
    padded_steps_match(mla(case), ATOL)


@pytest.mark.parametrize("case", CASES)
def test_the_absorbed_step_equals_the_unabsorbed_one(case: str) -> None:
    """With a cache, LatentAttention folds kv_b's key half into the query and applies its value half
    after attention; without, it builds every head's K and V: the two agree to 1e-5 in fp32, for a
    whole block and one token at a time, and the cache holds the latent and the rotary key only, one
    head of kv_lora_rank + qk_rope_head_dim, no V."""
    m = mla(case)
    attn = m.transformer.h[1].attn
    assert isinstance(attn, LatentAttention)
    x = torch.randn(2, 12, 32)
    rope = None
    if m.config.pos_encoding == "rope":
        rope = (m.rope_cos[:12][None, None], m.rope_sin[:12][None, None])
    unabsorbed = attn(x, rope, None, None)
    cache = m.make_kv_cache(2, 12)
    absorbed = attn(x, rope, None, cache)  # layer 1 of the cache, from position 0
    torch.testing.assert_close(absorbed, unabsorbed, rtol=0, atol=ATOL)
    c = m.config
    assert (
        cache.stores[0].k.shape == (2, 2, 1, 12, c.kv_lora_rank + c.qk_rope_head_dim)
        and cache.stores[0].v.numel() == 0
    )
    latent, k_rope = attn.kv_a(x).split((c.kv_lora_rank, c.qk_rope_head_dim), dim=-1)
    latents = cache.stores[0].k[1, :, 0, :, : c.kv_lora_rank]
    torch.testing.assert_close(latents, attn.kv_norm(latent))
    if rope is not None:  # the rotary key is stored rotated; the latent carries no position
        assert not torch.allclose(cache.stores[0].k[1, :, 0, :, c.kv_lora_rank :], k_rope)


@pytest.mark.parametrize("case", CASES)
def test_latent_cache_bytes_and_parameters_follow_the_formulas(case: str) -> None:
    m = mla(case)
    c = m.config
    D, H, hd, R, dR, L, V = 32, 4, 8, c.kv_lora_rank, c.qk_rope_head_dim, 2, 61
    assert (
        dR == {"r8-rope": hd // 2, "r24-rope-q16": 4, "r12-learned": 0}[case]
    )  # default: head_dim / 2 with rope
    for dtype, size in [(torch.float32, 4), (torch.bfloat16, 2)]:
        for batch, seq in [(1, 32), (3, 7)]:
            expected = L * batch * seq * (R + dR) * size  # (d_c + d_R) values a token and layer
            assert c.kv_cache_bytes(batch, seq, dtype) == expected
            assert m.make_kv_cache(batch, seq, dtype=dtype).nbytes == expected
    q_width = H * (hd + dR)
    queries = (
        D * q_width + q_width
        if c.q_lora_rank is None
        else (D * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * q_width)
    )  # q_a (+ bias), q_norm, q_b
    attn = queries + (D + 1) * (R + dR) + R + R * 2 * D + D * D + D  # kv_a, kv_norm, kv_b, c_proj
    assert m.attention_params_per_layer() == attn
    block = (
        attn + 2 * D * 4 * D + 4 * D + D + 4 * D
    )  # + MLP with biases + two LayerNorms (weight, bias)
    assert m.num_params() == L * block + 2 * D + V * D + (
        32 * D if dR == 0 else 0
    )  # ln_f, wte, wpe (learned)
    mha_cache = GPTConfig(n_layer=L, n_head=H, n_embd=D).kv_cache_bytes(1, 32)
    assert mha_cache == c.kv_cache_bytes(1, 32) * 2 * D // (R + dR)


@pytest.mark.parametrize("case", ["r8-rope", "r12-learned"])
def test_greedy_tokens_past_block_size_from_the_cache_equal_recomputation(case: str) -> None:
    """The window slides past block_size (the rows' own caches refilled and compacted) as for GQA:
    each row of a padded batch gets its prompt's tokens alone, which equal the by-hand
    recomputation."""
    assert distinct(rows_as_by_hand(mla(case, block_size=16))) >= 10


@pytest.mark.parametrize("case", ["r8-rope", "r24-rope-q16"])
def test_the_static_step_equals_the_cached_forward(case: str) -> None:
    """decode_static (CUDA graphs replay it; the compiled CPU step exports it) writes the latent
    cache in place."""
    ref, static, filled = static_steps_match(mla(case), range(5, 8), 20)
    for cache in (static, filled):
        torch.testing.assert_close(cache.stores[0].k[..., :8, :], ref.stores[0].k[..., :8, :])


def test_mla_trains_and_compiles_without_graph_breaks() -> None:
    first, last = first_and_last_loss(mla("r24-rope-q16").train(), 30)
    assert last < 0.5 * first


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (dict(qk_rope_head_dim=4), ["qk_rope_head_dim=4 is an MLA key", "kv_lora_rank"]),
        (dict(q_lora_rank=8), ["q_lora_rank=8 is an MLA key"]),
        (dict(kv_lora_rank=8, n_kv_head=2), ["n_kv_head=2 does not apply to MLA"]),
        (dict(kv_lora_rank=0), ["kv_lora_rank=0"]),
        (
            dict(kv_lora_rank=8, pos_encoding="rope", qk_rope_head_dim=3),
            ["even qk_rope_head_dim", "3"],
        ),
        (
            dict(kv_lora_rank=8, pos_encoding="rope", qk_rope_head_dim=0),
            ["qk_rope_head_dim=0", "'rope'"],
        ),
        (dict(kv_lora_rank=8, qk_rope_head_dim=4), ["qk_rope_head_dim=4", "0 with 'learned'"]),
        (dict(norm="batchnorm", mlp="relu"), ["norm='batchnorm'", "mlp='relu'"]),
    ],
)
def test_bad_mla_and_block_keys_are_one_line(overrides: dict, names: list[str]) -> None:
    msg = config_error(**overrides)
    assert all(name in msg for name in names), msg


def test_the_llama_block_is_rmsnorm_and_swiglu_with_gpt2s_parameter_budget() -> None:
    """norm='rmsnorm', mlp='swiglu': RMSNorm without bias and c_proj(silu(c_gate(x)) * c_fc(x)) of
    8/3 n_embd (rounded to 8) hidden units, about the GELU MLP's weights; the defaults are GPT-2's
    block."""
    llama = tiny_model(None, "rope", norm="rmsnorm", mlp="swiglu", bias=False)
    gpt2 = tiny_model(None, "rope", bias=False)
    assert llama.config.mlp_hidden == 88 and gpt2.config.mlp_hidden == 128
    mlp = sum(p.numel() for p in llama.transformer.h[0].mlp.parameters())
    assert (
        mlp == 3 * 32 * 88 and abs(mlp - 8 * 32 * 32) <= 3 * 32 * 4
    )  # within half a step of 8 hidden units
    block = llama.transformer.h[0]
    assert isinstance(block.ln_1, torch.nn.RMSNorm) and isinstance(
        gpt2.transformer.h[0].ln_1, torch.nn.LayerNorm
    )
    x = torch.randn(2, 5, 32)
    by_hand = block.mlp.c_proj(
        torch.nn.functional.silu(x @ block.mlp.c_gate.weight.T) * (x @ block.mlp.c_fc.weight.T)
    )
    torch.testing.assert_close(block.mlp(x), by_hand)
    rms = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * block.ln_1.weight
    torch.testing.assert_close(block.ln_1(x), rms)
