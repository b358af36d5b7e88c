"""Local layers (window, window_pattern): a local layer's output ignores the tokens beyond its
window (a hand-built oracle); a local layer's cache is a ring of its window's slots, whose bytes
follow the per-layer formula; and every decoding path gives what recomputation with the same masks
gives (chunks, padding, past block_size, the static and compiled steps)."""

import pytest
import torch
from test_generate import rows_as_by_hand

from attention import attention_mask
from conftest import (
    cached_chunks_match,
    config_error,
    distinct,
    first_and_last_loss,
    lively,
    padded_steps_match,
    static_steps_match,
    tiny_model,
)
from model import GPTConfig

ATOL = 1e-5
CASES = {
    "gqa-rope": dict(n_kv_head=2, pos_encoding="rope"),
    "mha-learned": dict(pos_encoding="learned"),
    "mla-rope": dict(kv_lora_rank=16, pos_encoding="rope"),
}


def windowed(
    case: str, window: int = 4, pattern: str = "S", **overrides: object
) -> torch.nn.Module:
    torch.manual_seed(0)
    overrides = CASES[case] | overrides
    m = lively(
        tiny_model(
            overrides.pop("n_kv_head", None), window=window, window_pattern=pattern, **overrides
        )
    )
    with torch.no_grad():  # lively's sharp attention for MLA's keys too: its latent, as its queries
        for name, p in m.named_parameters():
            if name.endswith("kv_a.weight"):
                p.mul_(4.0)
    return m


def test_the_mask_is_the_window_written_out_by_hand() -> None:
    """Queries at 5, 6 over keys 0..6 with window 3, row 1 left-padded by 2 slots: each query sees
    itself and the 2 slots before it, never a pad slot unless it is one (then only itself)."""
    mask = attention_mask(2, 5, torch.tensor([0, 2]), torch.device("cpu"), window=3)
    want = torch.tensor(
        [
            [[0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 1, 1, 1]],
            [[0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 1, 1, 1]],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask[:, 0], want)
    assert (
        attention_mask(3, 0, None, torch.device("cpu"), window=3) is None
    )  # no key beyond the window: causal
    assert attention_mask(1, 3, None, torch.device("cpu"), window=3)[0, 0, 0].tolist() == [
        0,
        1,
        1,
        1,
    ]


@pytest.mark.parametrize("case", CASES)
def test_a_local_layer_ignores_the_tokens_beyond_its_window(case: str) -> None:
    """Layer 0 local (window 4), layer 1 global: the local layer's output at the last position is
    the same whatever the token 4 places back, and moves with the one 3 places back; the model's
    output moves with the first token (the global layer reads the local layer's output at every
    position)."""
    m = windowed(case)
    assert m.config.layer_windows == [4, None]
    outs = []
    hook = m.transformer.h[0].register_forward_hook(lambda mod, args, out: outs.append(out[:, -1]))
    idx = torch.randint(0, 61, (2, 12))
    for changed in (None, 12 - 5, 12 - 4, 0):
        other = idx.clone()
        if changed is not None:
            other[:, changed] = (idx[:, changed] + 1) % 61
        logits = m(other)[0][:, -1]
        outs[-1] = (outs[-1], logits)
    hook.remove()
    (base, logits), (far, _), (near, _), (_, first) = outs
    assert torch.equal(far, base)  # 5 back from the last: beyond the window
    assert (near - base).abs().max() > 1e-3  # 4 back: the last slot of the window
    assert (first - logits).abs().max() > 1e-3


@pytest.mark.parametrize("case", CASES)
def test_cached_steps_chunks_and_padding_equal_recomputation_with_the_windows(case: str) -> None:
    m = windowed(case, block_size=32)
    cached_chunks_match(m)
    padded_steps_match(m)


@pytest.mark.parametrize("window", [1, 40])
def test_a_ring_of_one_slot_or_of_the_whole_cache_equals_recomputation(window: int) -> None:
    """A window of 1 (a local layer sees only its own token) and one longer than the cache (its
    ring: the cache's max_len slots, never turned; the window below block_size, as GPTConfig
    requires)."""
    m = windowed("gqa-rope", window=window, pattern="SSL", n_layer=3, block_size=48)
    cached_chunks_match(m)
    padded_steps_match(m)


@pytest.mark.parametrize(("case", "window"), [("gqa-rope", 5), ("mla-rope", 5), ("gqa-rope", 12)])
def test_greedy_tokens_past_block_size_equal_recomputation_with_the_windows(
    case: str, window: int
) -> None:
    """Rows slide (block_size // 2 = 8 tokens kept, 7 refilled on their own) and the batch's cache
    is moved left: each local layer's ring (5 slots: fewer than a refill writes; 12: more) turns
    with it."""
    m = windowed(case, window=window, pattern="SL", n_layer=3, block_size=16)
    assert m.config.layer_windows == [window, None, None]
    assert distinct(rows_as_by_hand(m)) >= 10


@pytest.mark.parametrize("window", [3, 32, 50])
def test_a_local_layers_cache_holds_its_window_and_the_bytes_follow_the_per_layer_formula(
    window: int,
) -> None:
    """3 layers, the first two local: a global layer keeps every position, a local one
    min(window, max_len) (its ring); GQA's 2 K/V heads of 8 features, or MLA's latent of 16 and
    rotary key of 4, in fp32."""
    B, max_len = 3, 32
    kept = 2 * min(window, max_len) + max_len  # the layers' positions
    for case, heads, k_width, v_width in [("gqa-rope", 2, 8, 8), ("mla-rope", 1, 20, 0)]:
        m = windowed(case, window=window, pattern="SSL", n_layer=3, block_size=64)
        want = B * kept * heads * (k_width + v_width) * 4
        cache = m.make_kv_cache(B, max_len)
        assert cache.nbytes == m.config.kv_cache_bytes(B, max_len) == want, case
        assert cache.stores[0].k.shape == (2, B, heads, min(window, max_len), k_width)
        assert cache.stores[1].k.shape == (1, B, heads, max_len, k_width)
    full = GPTConfig(n_layer=3, n_head=4, n_kv_head=2, n_embd=32, block_size=4096)
    pattern = GPTConfig(
        n_layer=3, n_head=4, n_kv_head=2, n_embd=32, block_size=4096, window=256, window_pattern="S"
    )
    assert full.kv_cache_bytes(1, 4096) == 3 * 4096 * 2 * 16 * 4
    assert pattern.kv_cache_bytes(1, 4096) == (2 * 256 + 4096) * 2 * 16 * 4


@pytest.mark.parametrize("case", ["gqa-rope", "mla-rope"])
def test_the_static_step_masks_each_local_layer_to_its_window(case: str) -> None:
    """decode_static (CUDA graphs replay it), over the whole cache or its filled length, equals the
    cached forward from the first token, while the ring fills and past it."""
    static_steps_match(windowed(case, window=3, block_size=24), range(1, 12), 24)


def test_a_windowed_model_trains_and_compiles_without_graph_breaks() -> None:
    first, last = first_and_last_loss(
        windowed("gqa-rope", window=8, pattern="SSL", n_layer=3).train(), 20
    )
    assert last < 0.7 * first


def test_the_pattern_repeats_over_the_layers_and_the_last_is_global() -> None:
    config = GPTConfig(n_layer=6, n_head=4, n_embd=32, window=16, window_pattern="SSL")
    assert config.layer_windows == [16, 16, None, 16, 16, None]
    assert GPTConfig(
        n_layer=3, n_head=4, n_embd=32, window=16, window_pattern="S"
    ).layer_windows == [16, 16, None]
    assert GPTConfig(n_layer=3, n_head=4, n_embd=32).layer_windows == [
        None,
        None,
        None,
    ]  # the default: all global


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (dict(window_pattern="SX", window=4), ["window_pattern='SX' must be letters S"]),
        (dict(window_pattern=""), ["window_pattern='' must be"]),
        (
            dict(window_pattern="SSSL"),
            ["window_pattern='SSSL' has local layers (S): give their window"],
        ),
        (dict(window=0, window_pattern="S"), ["window=0 must be a positive integer"]),
        (dict(window=8), ["window=8 with window_pattern='L': no layer is local"]),
    ],
)
def test_bad_window_keys_are_one_line(overrides: dict, names: list[str]) -> None:
    msg = config_error(**overrides)
    assert all(name in msg for name in names), msg
