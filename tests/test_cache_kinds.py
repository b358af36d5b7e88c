"""The cache owns its layout (issues 55, 67): each kind of layer keeps its own store (KVRows for
the global layers, KVRing for the local ones, States for the recurrent ones), made from its kind's
spec; the engine calls their operations (update, refill, shift, the static view, tensors) and no
code outside kv_cache.py reads or writes the tensors; and the model's one line,
GPTConfig.describe, which every script prints."""

import re
from dataclasses import dataclass

import torch

from conftest import ROOT, tiny_model
from kv_cache import (
    CacheShape,
    KVCache,
    KVRing,
    KVRows,
    RingSpec,
    RowsSpec,
    States,
    StateSpec,
)
from model import GPTConfig

# a cache's tensors by any of the names the engine ever used for them
CACHE_TENSORS = re.compile(r"\b\w*cache\w*\.(k|v|ring_k|ring_v|kinds|where|stores|parts)\b")


def test_no_code_outside_kv_cache_py_touches_a_caches_tensors() -> None:
    files = [*sorted((ROOT / "smallgpt").glob("*.py"))]
    files += [p for p in sorted(ROOT.glob("*.py")) if p.name != "kv_cache.py"]
    found = [
        f"{p.name}:{n}: {line.strip()}"
        for p in files
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if CACHE_TENSORS.search(line)
    ]
    assert found == []


def test_each_kind_of_layer_has_its_own_cache_and_the_bytes_add_up() -> None:
    m = tiny_model(2, pos_encoding="rope", n_layer=3, window=4, window_pattern="SL", block_size=32)
    cache = m.make_kv_cache(2, 16)
    ring, rows = cache.stores  # in the order of their first layer
    assert type(rows) is KVRows and type(ring) is KVRing
    assert rows.k.shape == (2, 2, 2, 16, 8) and ring.k.shape == (1, 2, 2, 4, 8)
    assert cache.nbytes == m.config.kv_cache_bytes(2, 16) == (2 * 16 + 4) * 2 * 2 * 2 * 8 * 4
    assert [t.data_ptr() for t in KVCache.of_tensors(cache.tensors(), cache.shape).tensors()] == [
        t.data_ptr() for t in cache.tensors()
    ]
    assert cache.growing() == [False, False, True, True]


def test_a_recurrent_layers_cache_is_its_state_and_does_not_grow() -> None:
    """A Gated DeltaNet layer keeps its convolution's last 3 inputs (q, k and v of its heads: 3 x
    32) and a state of head_dim x head_dim a head in fp32, in caches of any length: counted by
    hand beside the global layer's K/V rows."""
    m = tiny_model(2, pos_encoding="rope", n_layer=3, layer_pattern="DDL", block_size=64)
    for length in (16, 64):
        cache = m.make_kv_cache(2, length)
        recurrent, rows = cache.stores
        assert type(recurrent) is States and rows.layers == 1 and recurrent.layers == 2
        conv, state = recurrent.tensors()
        assert conv.shape == (2, 2, 96, 3) and state.shape == (2, 2, 4, 8, 8)
        kv = length * 2 * 2 * 8 * 4  # one layer: K and V of 2 heads of 8, fp32
        state = 2 * (96 * 3 * 4 + 4 * 8 * 8 * 4)  # two layers
        assert cache.nbytes == m.config.kv_cache_bytes(2, length) == 2 * (kv + state)
    bf16 = m.config.kv_cache_bytes(1, 16, torch.bfloat16)
    assert bf16 == 16 * 2 * 2 * 8 * 2 + 2 * (96 * 3 * 2 + 4 * 8 * 8 * 4)  # the state stays fp32


def test_refill_takes_a_rows_own_state_and_shift_and_reset_do_what_they_say() -> None:
    """A recurrent layer's cache holds no positions: a refill copies the rows' own state (and the
    convolution's inputs) whatever the positions, a shift leaves it, a reset zeroes the rows."""
    state_spec = StateSpec(((2, 2), (1, 2, 2)), (False, True))  # conv inputs, then the state
    shape = CacheShape((state_spec, RowsSpec(1, 1, 1)), 8)
    cache = KVCache.zeros(shape, 2, "cpu", torch.float32)
    cache.pos = 6
    conv, state = cache.stores[0].tensors()
    state.fill_(5.0)
    conv.fill_(5.0)
    own = KVCache.zeros(shape, 1, "cpu", torch.float32)
    own_conv, own_state = own.stores[0].tensors()
    own_state.copy_(torch.arange(4.0).view(1, 1, 1, 2, 2))
    own_conv.fill_(7.0)
    own.pos = 3
    cache.refill([1], own)
    assert state[0, 1, 0].tolist() == [[0, 1], [2, 3]] and (conv[0, 1] == 7).all()
    assert (state[0, 0] == 5).all()  # the other row untouched
    cache.shift(2)
    assert cache.pos == 4 and state[0, 1, 0].tolist() == [[0, 1], [2, 3]]
    cache.refill([0], None)
    assert not state[0, 0].any() and not conv[0, 0].any()
    assert state[0, 1].any()


def test_refill_and_shift_move_each_kinds_positions() -> None:
    """Written by hand: a row's own cache of 3 positions refilled right-aligned at pos 6 lands at
    slots 3..5 of the rows and, in the ring of 4, at slots 3 % 4, 4 % 4, 5 % 4; a shift by 2 moves
    the rows' positions 2..5 to 0..3 and turns the ring by 2."""
    specs = (RingSpec(1, 1, 1, 4), RowsSpec(1, 1, 1))
    cache = KVCache.zeros(CacheShape(specs, 8), 2, "cpu", torch.float32)
    cache.pos = 6
    own = KVCache.zeros(CacheShape(specs, 3), 1, "cpu", torch.float32)
    ring, rows = own.stores
    rows.k[0, 0, 0, :, 0] = torch.tensor([10.0, 11, 12])
    ring.k[0, 0, 0, :, 0] = torch.tensor([20.0, 21, 22])  # a ring of 3 slots (min(4, 3)): 20 at 0
    own.pos = 3
    cache.refill([1], own)
    big_ring, big_rows = cache.stores
    assert big_rows.k[0, 1, 0, :, 0].tolist() == [0, 0, 0, 10, 11, 12, 0, 0]
    assert big_rows.k[0, 0].abs().sum() == 0  # the other row untouched
    assert big_ring.k[0, 1, 0, :, 0].tolist() == [21, 22, 0, 20]  # positions 4, 5, -, 3
    cache.shift(2)
    assert cache.pos == 4
    assert big_rows.k[0, 1, 0, :4, 0].tolist() == [0, 10, 11, 12]
    assert big_ring.k[0, 1, 0, :, 0].tolist() == [0, 20, 21, 22]  # positions -, 1, 2, 3 after it


def test_describe_is_the_models_one_line() -> None:
    base = dict(n_layer=3, n_head=4, n_embd=32, block_size=32)
    gqa = GPTConfig(**base, n_kv_head=2, pos_encoding="rope", window=8, window_pattern="SSL")
    assert gqa.describe() == (
        "GQA (n_head=4, n_kv_head=2), rope positions, local layers [0, 1] of 3 (window 8)"
    )
    mla = GPTConfig(**base, kv_lora_rank=16, pos_encoding="rope")
    assert mla.describe() == (
        "MLA (n_head=4, kv_lora_rank=16, qk_rope_head_dim=4, q_lora_rank=None), rope positions"
    )
    mqa = GPTConfig(**base, n_kv_head=1)
    assert mqa.describe() == "MQA (n_head=4, n_kv_head=1), learned positions"
    # no attention layer: no attention kind named (the kind code dispatches on stays MHA's)
    recurrent = GPTConfig(**base, layer_pattern="D", pos_encoding="rope")
    assert recurrent.describe() == (
        "no attention layer: Gated DeltaNet layers [0, 1, 2] of 3 (n_head=4), rope positions"
    )
    assert (recurrent.attention_label, recurrent.attention_type) == ("none", "MHA")


def test_a_new_kind_of_cache_is_one_class() -> None:
    """A store the cache has never seen (here one of two slots a layer, whatever the length) is
    built from its spec, indexed, counted and passed through a compiled step's tensors with no
    other change."""

    class Fixed(KVRows):
        grows = False

    @dataclass(frozen=True)
    class FixedSpec(RowsSpec):
        def slots(self, max_len: int) -> int:
            return 2

        def wrap(self, tensors: list[torch.Tensor]) -> Fixed:
            return Fixed(*tensors)

        def zeros(self, *args: object) -> Fixed:
            return Fixed(*super().zeros(*args).tensors())

    shape = CacheShape((RowsSpec(1, 4, 4), FixedSpec(1, 4, 4), RowsSpec(1, 4, 4)), 8)
    cache = KVCache.zeros(shape, 1, "cpu", torch.float32)
    assert cache.where == [(0, 0), (1, 0), (0, 1)]
    assert cache.stores[1].k.shape == (1, 1, 1, 2, 4) and cache.stores[0].k.shape == (2, 1, 1, 8, 4)
    assert cache.nbytes == (2 * 8 + 2) * 4 * 2 * 4
    assert cache.growing() == [True, True, False, False]
    again = KVCache.of_tensors(cache.tensors(), cache.shape)
    assert [type(store) for store in again.stores] == [KVRows, Fixed]
