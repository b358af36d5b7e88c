"""Kimi Delta Attention (K in layer_pattern, kimi_delta.py) and Kimi Linear's MLA without positions:
the per-channel delta rule against its own recurrence and Gated DeltaNet's, the cache against
recomputing, and the layer and the model against transformers' KimiLinearForCausalLM (its torch
KDA) on the same weights; its int8, padded, compiled and hf: paths are in test_decode_matrix.py (the
KDA kind)."""

from pathlib import Path

import pytest
import torch

from conftest import lively, tiny_model
from smallgpt import delta_rule
from smallgpt.errors import UserError
from smallgpt.hf import to_hf
from smallgpt.hf_kimi import from_kimi_linear

# Kimi Linear's shape: three KDA layers, then MLA without positions
KIMI = dict(
    norm="rmsnorm",
    mlp="swiglu",
    bias=False,
    pos_encoding="rope",
    n_layer=4,
    layer_pattern="KKKL",
    kv_lora_rank=8,
    rope_pattern="N",
)


def inputs(T: int, per_channel: bool) -> tuple[torch.Tensor, ...]:
    """q, k (normalised), v, g (per channel or per head, strong decays: up to -3 a token), b and a
    nonzero state, in float64."""
    gen = torch.Generator().manual_seed(0)
    B, H, dk, dv = 2, 3, 8, 6

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k = (x / x.norm(dim=-1, keepdim=True) for x in (randn(B, H, T, dk), randn(B, H, T, dk)))
    g_shape = (B, H, T, dk) if per_channel else (B, H, T)
    g = -3 * torch.rand(g_shape, generator=gen, dtype=torch.float64)
    b = torch.rand(B, H, T, generator=gen, dtype=torch.float64)
    return q, k, randn(B, H, T, dv), g, b, randn(B, H, dk, dv)


def test_the_chunked_rule_with_a_decay_per_channel_is_its_recurrence() -> None:
    """delta_rule.chunked with g per channel equals the token-by-token recurrence in float64, from a
    nonzero state, over 45 tokens (chunks of 16: the last one cut), outputs and final state."""
    q, k, v, g, b, state = inputs(45, per_channel=True)
    want, want_state = delta_rule.recurrent(q, k, v, g, b, state)
    got, got_state = delta_rule.chunked(q, k, v, g, b, state, 16)
    assert (got - want).abs().max() < 1e-12 and (got_state - want_state).abs().max() < 1e-12
    # the channels' decays count: the mean decay of each token gives other outputs
    mean, _ = delta_rule.recurrent(q, k, v, g.mean(-1), b, state)
    assert (mean - want).abs().max() > 0.05


def test_one_decay_in_every_channel_is_gated_deltanets_rule() -> None:
    """KDA's rule with the same decay in every channel computes Gated DeltaNet's: the recurrence
    exactly, the chunked form within float64 rounding."""
    q, k, v, g, b, state = inputs(45, per_channel=False)
    every = g[..., None].expand(*g.shape, q.size(-1))
    for form in (delta_rule.recurrent, delta_rule.chunked):
        want, want_state = form(q, k, v, g, b, state)
        got, got_state = form(q, k, v, every, b, state)
        if form is delta_rule.recurrent:
            assert torch.equal(got, want) and torch.equal(got_state, want_state)
        assert (got - want).abs().max() < 1e-12 and (got_state - want_state).abs().max() < 1e-12


def test_prefill_and_decode_equal_one_forward() -> None:
    """A KDA model (and its MLA layer without positions: absorbed through the cache, unabsorbed
    without) decoding through the cache after a prefill of 5 tokens gives the logits of its whole
    prefix recomputed, in float64, across KDA's chunks of 32."""
    torch.manual_seed(0)
    m = lively(tiny_model(**KIMI, block_size=48)).double()
    idx = torch.randint(0, 61, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = m(idx, idx)[0]
        cache = m.make_kv_cache(2, 48)
        m(idx[:, :5], kv_cache=cache)
        steps = torch.cat([m(idx[:, t : t + 1], kv_cache=cache)[0] for t in range(5, 48)], 1)
        assert (steps - whole[:, 5:]).abs().max() < 1e-10
        # a prefill that ends in mid-chunk, then a chunk of 20 from its state
        cache = m.make_kv_cache(2, 48)
        m(idx[:, :21], kv_cache=cache)
        last = m(idx[:, 21:41], kv_cache=cache)[0][:, -1]
        assert (last - whole[:, 40]).abs().max() < 1e-10


def test_the_model_is_transformers_kimi_linear_on_the_same_weights(tmp_path: Path) -> None:
    """Exported (KimiLinearForCausalLM, dense, its torch KDA), the logits are ours within 1e-5
    relative, and its own greedy decoding through its cache (its recurrent KDA) is ours; read back
    (init_from=hf:), the same model."""
    torch.manual_seed(0)
    m = lively(tiny_model(**KIMI))
    hf = to_hf(m)
    assert type(hf).__name__ == "KimiLinearForCausalLM"
    idx = torch.randint(0, 61, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = m(idx, idx)[0]
        theirs = hf(idx).logits
        assert (ours - theirs).norm() / ours.norm() < 1e-5
        greedy = hf.generate(idx[:, :4], max_new_tokens=24, do_sample=False)
        from smallgpt.generation import generate

        assert torch.equal(generate(m, idx[:, :4], 24, temperature=0), greedy)
    sd = {k: v.float() for k, v in hf.state_dict().items()}
    config, state = from_kimi_linear(str(tmp_path), hf.config, sd)
    back = tiny_model(**KIMI)
    back.load_state_dict(state, strict=False)
    assert config.layer_pattern == "KKKL" and config.rope_pattern == "N"
    with torch.no_grad():  # the latents' rows scaled out and back: float rounding
        assert (back(idx, idx)[0] - ours).abs().max() < 1e-6


@pytest.mark.parametrize(
    "keys, message",
    [
        (dict(kv_lora_rank=None), "export needs MLA \\(kv_lora_rank\\) for Kimi Delta"),
        (dict(rope_pattern="R"), "no positions on the attention layers \\(rope_pattern='N'\\)"),
        (dict(layer_pattern="KDL"), "no other recurrent layers"),
    ],
)
def test_what_kimi_linear_cannot_hold_is_refused_in_one_line(keys: dict, message: str) -> None:
    with pytest.raises(UserError, match=message) as e:
        to_hf(tiny_model(**(KIMI | keys)))
    assert "\n" not in str(e.value)


def test_the_llama_cpp_folder_has_the_checkpoints_names_and_keys(tmp_path: Path) -> None:
    """The folder llama.cpp's kimi_linear converter reads: transformers saves the original
    checkpoint's names (one convolution a projection, q, k, v as ours one above the other; the
    forget gate's tensors under self_attn), and the config gets its keys: the layers 1-indexed in
    linear_attn_config, every MLP dense. The converter itself runs in bench.py --mode=gguf
    (docs/export.md)."""
    import json

    import safetensors.torch

    from smallgpt.hf import update_json
    from smallgpt.hf_kimi import llama_cpp_keys

    torch.manual_seed(0)
    m = tiny_model(**KIMI)
    to_hf(m, llama_cpp=True).save_pretrained(tmp_path)
    update_json(tmp_path / "config.json", llama_cpp_keys(m.config))
    config = json.loads((tmp_path / "config.json").read_text())
    linear = config["linear_attn_config"]
    assert (linear["full_attn_layers"], linear["kda_layers"]) == ([4], [1, 2, 3])
    assert config["first_k_dense_replace"] == 4 and linear["head_dim"] == 8
    state = safetensors.torch.load_file(tmp_path / "model.safetensors")
    p = "model.layers.0.self_attn."
    convs = [state[p + f"{x}_conv1d.weight"] for x in "qkv"]
    ours = m.transformer.h[0].attn
    assert torch.equal(torch.cat(convs).view(ours.conv.shape), ours.conv.detach())
    assert torch.equal(state[p + "A_log"].flatten(), ours.A_log.detach())
