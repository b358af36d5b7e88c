"""smallgpt/long_recall.py and the tasks smallgpt/recall.py runs with it: the needle and
long-MQAR generators place what they say where they say, a scripted lookup model solves every
example and a uniform guesser scores chance, a model with learned positions is refused past its
block_size, and a rotary model stretched to a longer context keeps its weights."""

import numpy as np
import pytest
import torch

from conftest import tiny_model
from smallgpt import long_recall, recall
from smallgpt.errors import UserError
from smallgpt.long_recall import Vocab

VOCAB = Vocab(keys=16, values=16, pairs=4, queries=3)


class Lookup(torch.nn.Module):
    """A scripted recall model: at each position, take the last key token up to it; if that key
    appeared earlier, predict the token that followed that earlier occurrence, offset by how far
    past the key this position is (a needle's span, or one MQAR answer); else token 0."""

    def __init__(self, vocab: Vocab, block_size: int) -> None:
        super().__init__()
        self.keys = vocab.keys
        self.vocab_size = vocab.keys + vocab.values
        self.config = tiny_model(pos_encoding="rope", block_size=block_size).config
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, None]:
        B, T = idx.shape
        logits = torch.zeros(B, T, self.vocab_size)
        for b in range(B):
            row = idx[b].tolist()
            first: dict[int, int] = {}  # a key's first position
            last_key = None  # (position, first position of that key)
            for t, token in enumerate(row):
                if token < self.keys:
                    last_key = (t, first.setdefault(token, t))
                if last_key and last_key[1] < last_key[0]:
                    source = last_key[1] + 1 + (t - last_key[0])
                    logits[b, t, row[source] if source < T else 0] = 1.0
        return logits, None


class Uniform(Lookup):
    """Every token equally likely, the top token drawn at random (seeded)."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, None]:
        gen = torch.Generator().manual_seed(int(idx.sum()))
        return torch.rand(*idx.shape, self.vocab_size, generator=gen), None


@pytest.mark.parametrize("span", [1, 3])
@pytest.mark.parametrize("length", [16, 37])
def test_the_needle_sits_exactly_at_its_depth_and_the_answer_is_what_followed_it(
    length: int, span: int
) -> None:
    for depth in long_recall.DEPTHS:
        rng = np.random.default_rng(0)
        idx, targets = long_recall.needle_batch(rng, 8, length, depth, VOCAB, span)
        seq = torch.cat([idx, targets[:, -1:]], 1)  # the sequence: inputs, then the last answer
        at = round(depth * (length + 1 - 2 * (span + 1)))
        assert idx.shape == targets.shape == (8, length)
        keys = (seq < VOCAB.keys).nonzero()
        # the key twice a row, at the needle's position and as the question
        assert keys[:, 1].view(8, 2).tolist() == [[at, length - span]] * 8
        assert torch.equal(seq[:, at], seq[:, length - span])
        assert torch.equal(targets[:, -span:], seq[:, at + 1 : at + 1 + span])
        assert (targets[:, :-span] == -1).all() and (targets[:, -span:] >= VOCAB.keys).all()
    # depth 0 is the first token; depth 1 leaves the needle's span right before the question
    assert long_recall.needle_position(16, 0.0, 3) == 0
    assert long_recall.needle_position(16, 1.0, 3) + 3 + 1 == 16 - 3


def test_long_mqar_examples_have_distinct_keys_and_the_values_they_ask_for() -> None:
    rng = np.random.default_rng(1)
    idx, targets = long_recall.mqar_batch(rng, 16, 40, VOCAB)
    seq = torch.cat([idx, targets[:, -1:]], 1)
    P, Q = VOCAB.pairs, VOCAB.queries
    for row, want in zip(seq.tolist(), targets.tolist(), strict=True):
        pairs = dict(zip(row[: 2 * P : 2], row[1 : 2 * P : 2], strict=True))
        asked = row[-2 * Q :: 2]
        assert len(pairs) == P and len(set(asked)) == Q and set(asked) <= set(pairs)
        assert all(token >= VOCAB.keys for token in row[2 * P : -2 * Q])  # filler: no keys
        answers = [w for w in want if w >= 0]
        assert answers == [pairs[key] for key in asked]
        assert [i for i, w in enumerate(want) if w >= 0] == list(range(40 - 2 * Q + 1, 40, 2))


def test_a_lookup_model_solves_every_cell_and_a_uniform_one_scores_chance() -> None:
    lookup = Lookup(VOCAB, block_size=64)
    cells = recall.needle(lookup, VOCAB, [24, 64], [0.0, 0.5, 1.0], span=2, examples=12)
    assert [(c["length"], c["depth"]) for c in cells] == [
        (n, d) for n in (24, 64) for d in (0.0, 0.5, 1.0)
    ]
    assert all(c["solved"] == c["n"] == 12 and c["high"] == 1.0 for c in cells)
    assert all(c["low"] == pytest.approx(0.025 ** (1 / 12)) for c in cells)  # exact at k = n
    [cell] = recall.mqar_long(lookup, VOCAB, [48], examples=12)
    assert cell["solved"] == 12 and cell["accuracy"] == 1.0
    uniform = Uniform(VOCAB, block_size=64)
    [cell] = recall.needle(uniform, VOCAB, [24], [0.5], span=1, examples=1200, batch_size=400)
    chance = 1 / (VOCAB.keys + VOCAB.values)
    assert cell["low"] < chance < cell["high"] and cell["high"] < 3 * chance
    [cell] = recall.mqar_long(uniform, VOCAB, [24], examples=1200, batch_size=400)
    assert cell["solved"] <= 3 and cell["accuracy"] == pytest.approx(chance, abs=0.02)


def test_learned_positions_are_refused_past_block_size_and_rotary_ones_stretched() -> None:
    learned = tiny_model(block_size=32)
    assert long_recall.stretched(learned, 32) is learned
    with pytest.raises(UserError, match=r"block_size=32 positions and has none past them"):
        recall.needle(learned, VOCAB, [64], [0.5])
    rotary = tiny_model(pos_encoding="rope", block_size=32, layer_pattern="DL")
    with torch.no_grad():  # sharpened: a random model at initialisation mostly repeats itself
        for p in rotary.parameters():
            p.mul_(4.0)
    longer = long_recall.stretched(rotary, 96)
    assert longer.config.block_size == 96 and rotary.config.block_size == 32
    idx = torch.randint(0, 61, (2, 96))
    with torch.no_grad():
        short, _ = rotary(idx[:, :32], idx[:, :32])
        long, _ = longer(idx, idx)
    torch.testing.assert_close(long[:, :32], short, rtol=1e-5, atol=1e-5)
    assert long.shape == (2, 96, 61)


def test_an_mqar_dataset_without_its_settings_is_one_line() -> None:
    meta = {"settings": {"key_vocab": 16, "value_vocab": 16, "num_pairs": 4, "num_queries": 3}}
    assert Vocab.of(meta, "D") == VOCAB
    with pytest.raises(UserError, match="D/meta.json's settings, which it does not record"):
        Vocab.of({"example_tokens": 64}, "D")
