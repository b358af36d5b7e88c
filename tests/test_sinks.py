"""Attention sinks (attn_sinks: a learned logit a head whose share of the softmax reads nothing,
gpt-oss's) and layers without positions (rope_pattern's N, NoPE), against oracles written by hand
here; their export, cache, int8, compiled and padded paths are in test_decode_matrix.py (the
sinks-NoPE and MLA-window-GDN kinds)."""

import pytest
import torch

from attention import with_sinks
from conftest import lively, tiny_model
from model import GPTConfig
from smallgpt.fast_paths import sdpa
from smallgpt.hf_llama import NO_SINK

LLAMA = dict(norm="rmsnorm", mlp="swiglu", bias=False, pos_encoding="rope")


def sigmoid_form(q, k, v, mask, sinks, scale):
    """transformers' GraniteSWA form, by hand: softmax(scores) V times sigmoid(LSE - sink), K/V
    heads repeated over their query heads."""
    group = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ k.mT) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = scores.logsumexp(-1, keepdim=True)
    return scores.softmax(-1) @ v * torch.sigmoid(lse - sinks.view(1, -1, 1, 1))


@pytest.mark.parametrize("window", [None, 3])
def test_the_extra_key_is_the_sigmoid_form_in_value_and_gradient(window: int | None) -> None:
    """with_sinks' extra key through sdpa() equals the sigmoid form in float64 within 1e-6, GQA
    (4 query heads over 2 K/V heads), causal or windowed; so do the gradients of q, k, v and the
    sinks (the sink's own comes through the LSE)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 7, 8, generator=gen, dtype=torch.float64) * 2
    k = torch.randn(2, 2, 7, 8, generator=gen, dtype=torch.float64) * 2
    v = torch.randn(2, 2, 7, 8, generator=gen, dtype=torch.float64)
    sinks = torch.tensor([-1.0, 0.5, 2.0, 4.0], dtype=torch.float64)
    # sdpa() reads None as the causal mask; the oracle needs it written
    pos = torch.arange(7)
    causal = (pos[None] <= pos[:, None])[None, None]
    mask = None if window is None else causal & (pos[None] > pos[:, None] - window)
    inputs = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    ours = sdpa(*with_sinks(*inputs[:3], mask, inputs[3], 8**-0.5), 0.0, False, scale=8**-0.5)
    oracle_inputs = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    want = sigmoid_form(
        *oracle_inputs[:3], causal if mask is None else mask, oracle_inputs[3], 8**-0.5
    )
    assert (ours - want).abs().max() < 1e-6
    # the sinks took a real share: without them the output differs
    assert (sdpa(q, k, v, mask, 0.0, False) - want).abs().max() > 0.05
    grad = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    ours.backward(grad)
    want.backward(grad)
    for a, b in zip(inputs, oracle_inputs, strict=True):
        assert (a.grad - b.grad).abs().max() < 1e-6


def test_sinks_pinned_at_no_sink_give_todays_outputs() -> None:
    """A model with sinks pinned at -1e4 computes what the same weights without sinks compute,
    in float64, with and without a cache, local and global layers."""
    torch.manual_seed(0)
    keys = LLAMA | dict(n_kv_head=2, window=4, window_pattern="SL")
    plain = lively(tiny_model(**keys)).double()
    pinned = tiny_model(**keys, attn_sinks=True).double()
    state = plain.state_dict() | {
        f"transformer.h.{i}.attn.sinks": torch.full((4,), NO_SINK, dtype=torch.float64)
        for i in range(2)
    }
    pinned.load_state_dict(state)
    idx = torch.randint(0, 61, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (pinned(idx, idx)[0] - plain(idx, idx)[0]).abs().max() < 1e-12
        for m in (plain, pinned):
            cache = m.make_kv_cache(2, 20)
            m(idx[:, :10], kv_cache=cache)
            m.last = m(idx[:, 10:11], kv_cache=cache)[0]
        assert (pinned.last - plain.last).abs().max() < 1e-12


def test_the_cache_equals_recomputing_past_a_window_with_sinks() -> None:
    """Decoding through the cache past a local layer's window (4 tokens) gives the logits of the
    whole prefix recomputed, with sinks that take a share, in float64."""
    torch.manual_seed(0)
    m = lively(tiny_model(**LLAMA, n_kv_head=2, window=4, window_pattern="SL", attn_sinks=True))
    m = m.double()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("sinks"):
                p.normal_(2.0, 4.0)
    idx = torch.randint(0, 61, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = m.make_kv_cache(2, 24)
        m(idx[:, :3], kv_cache=cache)
        for t in range(3, 24):
            step = m(idx[:, t : t + 1], kv_cache=cache)[0][:, -1]
            whole = m(idx[:, : t + 1])[0][:, -1]
            assert (step - whole).abs().max() < 1e-10, t


def test_a_nope_layer_is_unchanged_by_shifting_every_position() -> None:
    """A layer of rope_pattern's N gives the same output whatever positions its tokens are at:
    shifted (the rotary tables of positions 9.. instead of 0..) or scrambled; its neighbour R
    layer, which rotation makes relative, keeps its output under the shift (to rounding) but not
    when the positions are scrambled."""
    torch.manual_seed(0)
    m = lively(tiny_model(**LLAMA, n_kv_head=2, rope_pattern="RN")).double()
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    tokens = torch.zeros(1, 12, dtype=torch.long)
    scrambled = torch.randperm(12, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        tables = [m.embed(tokens, p)[1] for p in (torch.arange(12), torch.arange(9, 21), scrambled)]
        rotary, nope = (m.transformer.h[i].attn for i in (0, 1))
        first = [rotary(x, rope, None, None) for rope in tables]
        second = [nope(x, rope, None, None) for rope in tables]
    assert torch.equal(second[0], second[1]) and torch.equal(second[0], second[2])
    assert (first[0] - first[1]).abs().max() < 1e-6
    assert (first[0] - first[2]).abs().max() > 1e-2


@pytest.mark.parametrize(
    "keys, message",
    [
        (dict(attn_sinks="yes"), "attn_sinks='yes' must be True or False"),
        (dict(rope_pattern="RX"), "rope_pattern='RX' must be letters R"),
        (dict(rope_pattern="RN", pos_encoding="learned"), "it needs pos_encoding='rope'"),
        (
            dict(attn_sinks=True, layer_pattern="D"),
            "attn_sinks=True is read only by global and local attention",
        ),
        # letters that would change nothing: past the last layer, or N on a layer without positions
        (
            dict(rope_pattern="RRRN"),
            r"rope_pattern='RRRN' has 4 letters and n_layer=2: the letters past layer 2 name no "
            r"layer \(the model's layers would be 'RR'\); give at most 2",
        ),
        (
            dict(rope_pattern="NR", layer_pattern="DL"),
            "rope_pattern='NR' takes the positions off layer 0, of Gated DeltaNet, which has none",
        ),
        (
            dict(n_layer=4, rope_pattern="NNRN", layer_pattern="KKKL"),
            "takes the positions off layer 0, 1, of Kimi Delta Attention, which has none",
        ),
    ],
)
def test_a_wrong_sink_or_nope_key_is_one_line(keys: dict, message: str) -> None:
    base = dict(n_layer=2, n_head=4, n_embd=32, block_size=32, vocab_size=61, pos_encoding="rope")
    with pytest.raises(ValueError, match=message) as e:
        GPTConfig(**(base | keys))
    assert "\n" not in str(e.value)


def test_the_exported_granite_swa_computes_our_logits() -> None:
    """Exported (GraniteSWAForCausalLM: the trained sinks, a rotary base of 0 on the NoPE layer),
    transformers' eager attention gives our logits within 1e-5 relative, past the window, with
    sinks that take a share; the same folder without our sinks does not."""
    from smallgpt.hf import to_hf

    torch.manual_seed(0)
    keys = LLAMA | dict(n_kv_head=2, window=4, window_pattern="SL", attn_sinks=True)
    m = lively(tiny_model(**keys, rope_pattern="RN"))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("sinks"):
                p.normal_(2.0, 4.0)
    hf = to_hf(m)
    assert type(hf).__name__ == "GraniteSWAForCausalLM"
    assert hf.config.layer_rope_theta == [10000.0, 0]
    idx = torch.randint(0, 61, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours = m(idx, idx)[0]
        assert (hf(idx).logits - ours).norm() / ours.norm() < 1e-5
        for layer in hf.model.layers:
            layer.self_attn.sinks.fill_(NO_SINK)
        assert (hf(idx).logits - ours).norm() / ours.norm() > 1e-3
