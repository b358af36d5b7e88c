"""Recall past the trained length: a needle (a key and the span of value tokens after it; a
passkey when the span is longer than one token) hidden at a chosen depth in filler and asked for
at the end, and multi-query associative recall with more filler than the model trained on, at 1x
to 8x its block_size. In an MQAR dataset's tokens (data/mqar: keys 0..K-1, values and filler
K..K+V-1), so a model trained on MQAR is asked what it learnt, only further away. Each example is
solved when every answer token is the model's top token; a cell reports solved k/n with its
Clopper-Pearson interval. Positions a model learnt one embedding each for (pos_encoding='learned')
do not exist past its block_size: such a model is refused in one line. Here: the tasks' inputs,
the stretched model and a cell's record; smallgpt/recall.py runs them as eval.py's tasks 'needle'
and 'mqar_long'."""

import dataclasses

import numpy as np
import torch

from model import GPT, GPTConfig
from smallgpt.errors import UserError
from smallgpt.stats import exact_interval

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)  # where the needle sits: 0 first, 1 just before the question
STRETCHES = (1, 2, 4, 8)  # the default lengths: these multiples of block_size


@dataclasses.dataclass(frozen=True, slots=True)
class Vocab:
    """An MQAR dataset's token ranges and example shape (its meta's settings)."""

    keys: int  # key ids 0..keys-1
    values: int  # value (and filler) ids keys..keys+values-1
    pairs: int  # key-value pairs an example
    queries: int  # of them asked at its end

    @classmethod
    def of(cls, meta: dict, where: str) -> "Vocab":
        """The vocabulary of the MQAR dataset at where, from its meta.json; a UserError for one
        prepared before meta.json recorded its settings."""
        s = meta.get("settings", {})
        keys = ("key_vocab", "value_vocab", "num_pairs", "num_queries")
        if not all(k in s for k in keys):
            raise UserError(
                f"needle and mqar_long read the key and value ranges from {where}/meta.json's "
                "settings, which it does not record (prepared by an older data/mqar/prepare.py): "
                "prepare it again"
            )
        return cls(*(s[k] for k in keys))


def default_lengths(block_size: int) -> list[int]:
    """1x, 2x, 4x and 8x block_size."""
    return [s * block_size for s in STRETCHES]


def needle_position(length: int, depth: float, span: int) -> int:
    """Where the needle's key sits in a sequence of length + 1 tokens whose last span + 1 are the
    question (the key again) and its answer: depth 0 the first token, depth 1 right before the
    question, rounded to the nearest token between."""
    last = length + 1 - 2 * (span + 1)  # the needle's key position just before the question
    return round(depth * last)


def needle_batch(
    rng: np.random.Generator, n: int, length: int, depth: float, vocab: Vocab, span: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (n, length): filler of random value tokens, at needle_position a
    random key followed by `span` random value tokens, and at the end the same key then the same
    span; the targets are the span's tokens after the final key (the answer), -1 elsewhere."""
    if length + 1 < 2 * (span + 1):
        raise UserError(f"a needle of {span} tokens and its question do not fit {length} tokens")
    seq = rng.integers(vocab.keys, vocab.keys + vocab.values, size=(n, length + 1))
    key = rng.integers(0, vocab.keys, size=n)
    answer = rng.integers(vocab.keys, vocab.keys + vocab.values, size=(n, span))
    at = needle_position(length, depth, span)
    seq[:, at] = key
    seq[:, at + 1 : at + 1 + span] = answer
    seq[:, -(span + 1)] = key
    seq[:, -span:] = answer
    answers = np.zeros(seq.shape, dtype=bool)
    answers[:, -span:] = True
    return as_inputs_and_targets(seq, answers)


def as_inputs_and_targets(seq: np.ndarray, answers: np.ndarray) -> tuple[torch.Tensor, ...]:
    """Sequences (n, length + 1) as next-token inputs and targets (n, length), the targets -1
    except where answers (n, length + 1) marks the token."""
    seq = torch.from_numpy(seq.astype(np.int64))
    targets = seq[:, 1:].masked_fill(~torch.from_numpy(answers[:, 1:]), -1)
    return seq[:, :-1], targets


def mqar_batch(
    rng: np.random.Generator, n: int, length: int, vocab: Vocab
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (n, length): data/mqar's compact layout over length + 1 tokens:
    `pairs` key-value pairs of distinct keys, filler of value tokens, then `queries` of the keys
    (distinct, in random order) each followed by its value; the targets are those values, -1
    elsewhere."""
    P, Q, K, V = vocab.pairs, vocab.queries, vocab.keys, vocab.values
    if length + 1 < 2 * (P + Q):
        raise UserError(f"{P} pairs and {Q} queries do not fit {length} tokens")
    keys = rng.random((n, K)).argsort(axis=1)[:, :P]
    values = rng.integers(K, K + V, size=(n, P))
    asked = rng.random((n, P)).argsort(axis=1)[:, :Q]
    seq = rng.integers(K, K + V, size=(n, length + 1))
    seq[:, : 2 * P : 2] = keys
    seq[:, 1 : 2 * P : 2] = values
    seq[:, -2 * Q :: 2] = np.take_along_axis(keys, asked, axis=1)
    seq[:, 1 - 2 * Q :: 2] = np.take_along_axis(values, asked, axis=1)
    answers = np.zeros(seq.shape, dtype=bool)
    answers[:, 1 - 2 * Q :: 2] = True
    return as_inputs_and_targets(seq, answers)


def check_lengths(config: GPTConfig, lengths: list[int]) -> None:
    """A UserError if a model of config cannot read some of lengths: past its block_size where it
    learnt one embedding a position."""
    longest = max(lengths, default=0)
    if longest > config.block_size and config.pos_encoding == "learned":
        raise UserError(
            f"a context of {longest} tokens: this model learnt one position embedding for each "
            f"of its block_size={config.block_size} positions and has none past them, so recall "
            f"past its trained length cannot be measured (train with --pos_encoding=rope)"
        )


def stretched(model: GPT, length: int) -> GPT:
    """model, or a copy of it whose context holds length tokens (the same weights; rotary tables
    and masks for the longer context). A model with a learned embedding for each position has none
    past its block_size: a UserError."""
    if length <= model.config.block_size:
        return model
    check_lengths(model.config, [length])
    model = getattr(model, "module", model)  # the model under DDP or torch.compile
    model = getattr(model, "_orig_mod", model)
    config = model.config
    device = next(model.parameters()).device
    with torch.device(device):
        longer = GPT(dataclasses.replace(config, block_size=length))
    longer.load_state_dict(model.state_dict())
    return longer.train(model.training)


def cell(solved: int, n: int, **where: float) -> dict:
    """One cell's record: where it is, solved k/n and the Clopper-Pearson interval."""
    low, high = exact_interval(solved, n)
    return {**where, "solved": solved, "n": n, "rate": solved / n, "low": low, "high": high}
