import pytest
import torch

from conftest import VARIANTS, tiny_model
from kv_cache import KVCache
from model import GPT
from smallgpt.generation import generate, left_pad

ATOL = 1e-5  # float32; the cached and recomputed paths differ only in summation order


def recompute_last(m: GPT, idx: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
    return m(idx, pad=pad)[0][:, -1]


@pytest.mark.parametrize("pos_encoding", ["learned", "rope"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_then_decode_matches_recompute(variant: str, pos_encoding: str) -> None:
    m = tiny_model(VARIANTS[variant], pos_encoding)
    idx = torch.randint(0, 61, (3, 30))
    cache = m.make_kv_cache(3, 30)
    logits, _ = m(idx[:, :10], kv_cache=cache)  # prefill
    torch.testing.assert_close(logits[:, -1], recompute_last(m, idx[:, :10]), rtol=0, atol=ATOL)
    for t in range(10, 30):  # one token at a time
        logits, _ = m(idx[:, t : t + 1], kv_cache=cache)
        torch.testing.assert_close(
            logits[:, -1], recompute_last(m, idx[:, : t + 1]), rtol=0, atol=ATOL
        )
    assert cache.pos == 30


@pytest.mark.parametrize("pos_encoding", ["learned", "rope"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_chunked_prefill_matches_recompute(variant: str, pos_encoding: str) -> None:
    m = tiny_model(VARIANTS[variant], pos_encoding)
    idx = torch.randint(0, 61, (2, 32))
    cache = m.make_kv_cache(2)
    for a, b in [(0, 7), (7, 8), (8, 20), (20, 32)]:
        logits, _ = m(idx[:, a:b], kv_cache=cache)
        torch.testing.assert_close(logits[:, -1], recompute_last(m, idx[:, :b]), rtol=0, atol=ATOL)


@pytest.mark.parametrize("pos_encoding", ["learned", "rope"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_padded_batch_matches_each_prompt_alone(variant: str, pos_encoding: str) -> None:
    m = tiny_model(VARIANTS[variant], pos_encoding)
    prompts = [torch.randint(0, 61, (n,)).tolist() for n in (3, 9, 1, 6)]
    idx, pad = left_pad(prompts, pad_token=5)
    cache = m.make_kv_cache(len(prompts), 20)
    cached, _ = m(idx, kv_cache=cache, pad=pad)
    recomputed = recompute_last(m, idx, pad)
    torch.testing.assert_close(cached[:, -1], recomputed, rtol=0, atol=ATOL)
    extra = torch.randint(0, 61, (len(prompts), 8))
    for t in range(
        8
    ):  # decode a few tokens for the whole batch; every row must equal its prompt run alone
        cached, _ = m(extra[:, t : t + 1], kv_cache=cache, pad=pad)
        full = torch.cat([idx, extra[:, : t + 1]], dim=1)
        torch.testing.assert_close(cached[:, -1], recompute_last(m, full, pad), rtol=0, atol=ATOL)
        for row, p in enumerate(prompts):
            alone = torch.tensor([p + extra[row, : t + 1].tolist()])
            torch.testing.assert_close(
                cached[row, -1], recompute_last(m, alone)[0], rtol=0, atol=ATOL
            )


def test_cache_stores_kv_heads_unrepeated_and_is_written_in_place() -> None:
    m = tiny_model(1)
    cache = m.make_kv_cache(2, 16)
    k_ptr = cache.stores[0].k.data_ptr()
    assert cache.stores[0].k.shape == (2, 2, 1, 16, 8)  # (n_layer, B, n_kv_head, max_len, head_dim)
    m(torch.randint(0, 61, (2, 5)), kv_cache=cache)
    m(torch.randint(0, 61, (2, 1)), kv_cache=cache)
    assert cache.pos == 6 and cache.stores[0].k.data_ptr() == k_ptr
    assert (
        cache.stores[0].k[:, :, :, :6].abs().sum() > 0
        and cache.stores[0].k[:, :, :, 6:].abs().sum() == 0
    )


def test_cache_overflow_is_a_clear_error() -> None:
    m = tiny_model(2)
    cache = m.make_kv_cache(1, 8)
    m(torch.zeros(1, 6, dtype=torch.long), kv_cache=cache)
    with pytest.raises(ValueError, match="KV cache holds 8 positions, 9 needed"):
        m(torch.zeros(1, 3, dtype=torch.long), kv_cache=cache)
    assert cache.pos == 6  # nothing written by the refused call


def test_training_never_builds_a_cache_and_caches_are_not_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every KVCache made is recorded (its __init__ wrapped): a training forward and backward makes
    none, a cached generate makes one, and neither adds to the state_dict (same keys, none holding a
    cache's K/V)."""
    made = []
    init = KVCache.__init__

    def recorded(self: KVCache, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(KVCache, "__init__", recorded)
    m = tiny_model(2, "rope").train()
    keys = set(m.state_dict())
    idx = torch.randint(0, 61, (2, 17))
    _, loss = m(idx[:, :-1], targets=idx[:, 1:])
    loss.backward()
    assert made == [] and m.transformer.h[0].attn.c_q.weight.grad is not None
    generate(m.eval(), idx[:, :3], 5, temperature=0)
    assert len(made) == 1 and made[0].pos == 3 + 5 - 1  # the check sees the caches made
    state = m.state_dict()
    assert set(state) == keys and not any("cache" in k or "rope" in k for k in state)
    cache_memory = {t.untyped_storage().data_ptr() for c in made for t in c.tensors()}
    assert not any(t.untyped_storage().data_ptr() in cache_memory for t in state.values())
