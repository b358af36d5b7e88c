import pytest
import torch

from conftest import VARIANTS, tiny_model
from generation import left_pad, sample_logits


@pytest.mark.parametrize("pos_encoding", ["learned", "rope"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_with_and_without_cache_agree_past_block_size(variant: str, pos_encoding: str) -> None:
    m = tiny_model(VARIANTS[variant], pos_encoding, block_size=16)
    idx = torch.randint(0, 61, (2, 5))
    cached = m.generate(idx, 40, temperature=0)  # 45 tokens: the 16-token window slides several times
    recomputed = m.generate(idx, 40, temperature=0, use_cache=False)
    assert cached.shape == (2, 45)
    assert torch.equal(cached, recomputed)
    assert torch.equal(cached[:, :5], idx)


def test_prompt_longer_than_block_size_is_cropped_to_its_last_block() -> None:
    m = tiny_model(2, block_size=16)
    idx = torch.randint(0, 61, (1, 40))
    out = m.generate(idx, 3, temperature=0)
    assert torch.equal(out[:, :40], idx)
    assert torch.equal(out[:, 40:], m.generate(idx[:, -16:], 3, temperature=0)[:, 16:])


@pytest.mark.parametrize("pos_encoding", ["learned", "rope"])
def test_padded_batch_generates_what_each_prompt_does_alone(pos_encoding: str) -> None:
    m = tiny_model(2, pos_encoding)
    prompts = [torch.randint(0, 61, (n,)).tolist() for n in (2, 7, 4)]
    idx, pad = left_pad(prompts)
    batch = m.generate(idx, 12, temperature=0, pad=pad)
    for row, p in enumerate(prompts):
        alone = m.generate(torch.tensor([p]), 12, temperature=0)
        assert batch[row, -12:].tolist() == alone[0, -12:].tolist()


def test_eos_stops_each_row_and_the_batch() -> None:
    m = tiny_model(2)
    idx = torch.randint(0, 61, (3, 4))
    free = m.generate(idx, 10, temperature=0)
    eos = int(free[0, 6])  # the third token row 0 generates
    out = m.generate(idx, 10, temperature=0, eos=eos)
    for row in range(3):
        gen = out[row, 4:].tolist()
        if eos in gen:
            first = gen.index(eos)
            assert all(t == eos for t in gen[first:])
            assert gen[:first] == free[row, 4:4 + first].tolist()
    if all(eos in r for r in out[:, 4:].tolist()):
        assert out.size(1) < 14


def test_same_seed_same_tokens_different_seed_different_tokens() -> None:
    m = tiny_model(2)
    idx = torch.randint(0, 61, (1, 3))
    runs = [m.generate(idx, 30, temperature=1.0, generator=torch.Generator().manual_seed(s)) for s in (7, 7, 8)]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_top_k_1_is_greedy() -> None:
    logits = torch.randn(16, 50)
    assert torch.equal(sample_logits(logits, 1.0, top_k=1), logits.argmax(-1))
    m = tiny_model(2)
    idx = torch.randint(0, 61, (2, 3))
    assert torch.equal(m.generate(idx, 10, top_k=1), m.generate(idx, 10, temperature=0))


def test_top_p_keeps_only_the_nucleus() -> None:
    probs = torch.tensor([[0.5, 0.05, 0.3, 0.1, 0.05]])
    logits = probs.log()
    g = torch.Generator().manual_seed(0)
    drawn = {int(sample_logits(logits, 1.0, top_p=0.75, generator=g)) for _ in range(300)}
    assert drawn == {0, 2}  # 0.5 + 0.3 reaches 0.75; nothing else may be drawn
    drawn = {int(sample_logits(logits, 1.0, top_p=0.85, generator=g)) for _ in range(300)}
    assert drawn == {0, 2, 3}
    assert {int(sample_logits(logits, 1.0, top_p=0.1, generator=g)) for _ in range(50)} == {0}


def test_top_k_restricts_candidates() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0]])
    g = torch.Generator().manual_seed(0)
    assert {int(sample_logits(logits, 2.0, top_k=2, generator=g)) for _ in range(200)} == {0, 2}


def test_stream_yields_what_generate_returns() -> None:
    m = tiny_model(1, "rope")
    idx = torch.randint(0, 61, (2, 3))
    streamed = torch.stack(list(m.stream(idx, 9, temperature=0)), dim=1)
    assert torch.equal(streamed, m.generate(idx, 9, temperature=0)[:, 3:])
