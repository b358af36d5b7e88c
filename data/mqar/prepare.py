"""mqar: multi-query associative recall (Zoology, Arora et al. 2023), made in code.

Zoology: https://arxiv.org/abs/2312.04927

Each example of seq_len tokens: P key-value pairs `k1 v1 ... kP vP`, seq_len - 2P - 2Q filler
tokens, Q queries `q1 a1 ... qQ aQ`. Keys: distinct, from the key vocabulary (ids 0..K-1); values
and filler: from the value vocabulary (ids K..K+V-1), with replacement; q_j: Q distinct keys of the
example's P, in random order; a_j: q_j's value. The loss mask is 1 exactly at the answers a_j; no
val or test example equals a train example, and no test example a val one (a learning rate chosen on
val is measured on examples it never saw). Train with --block_size=<seq_len - 1>.
"""

from dataclasses import dataclass
from pathlib import Path

from configurator import run_cli  # first: a Ctrl-C while the libraries import is then one line

# isort: split
import numpy as np

from smallgpt.data import writing_dataset
from smallgpt.errors import UserError

MAX_VOCAB = 20000  # token id i is the character chr(0x4E00 + i), a CJK ideograph (U+4E00..U+9FFF)
ROUNDS = (
    100  # val draws of val_examples each, before giving up on examples unlike every train example
)


@dataclass(slots=True)
class PrepareConfig:
    out_dir: str = str(Path(__file__).resolve().parent)
    num_pairs: int = 8  # P: key-value pairs per example
    num_queries: int | None = None  # Q: queries per example, at most P; None: P
    key_vocab: int = 64  # K: key ids 0..K-1, at least P
    value_vocab: int = 64  # V: value ids K..K+V-1 (filler tokens too)
    seq_len: int | None = None  # tokens per example, at least 2P + 2Q; None: 2P + 2Q
    train_examples: int = 20000
    val_examples: int = 1000
    test_examples: int = 1000  # 0: no test split
    seed: int = 1337

    def __post_init__(self) -> None:
        self.num_queries = self.num_pairs if self.num_queries is None else self.num_queries
        sizes = (
            "num_pairs",
            "num_queries",
            "key_vocab",
            "value_vocab",
            "train_examples",
            "val_examples",
        )
        if self.test_examples < 0:
            raise ValueError(f"test_examples={self.test_examples} must be 0 or more")
        if bad := [f"{k}={getattr(self, k)}" for k in sizes if getattr(self, k) <= 0]:
            raise ValueError(f"{', '.join(bad)}: sizes and counts must be positive")
        if self.num_queries > self.num_pairs:
            raise ValueError(
                f"num_queries={self.num_queries} > num_pairs={self.num_pairs}: "
                "queries ask distinct keys"
            )
        if self.key_vocab < self.num_pairs:
            raise ValueError(
                f"key_vocab={self.key_vocab} < num_pairs={self.num_pairs}: "
                "an example's keys are distinct"
            )
        if (vocab := self.key_vocab + self.value_vocab) > MAX_VOCAB:
            raise ValueError(
                f"key_vocab + value_vocab = {vocab} > {MAX_VOCAB}, the ids it has characters for"
            )
        shortest = 2 * self.num_pairs + 2 * self.num_queries
        self.seq_len = shortest if self.seq_len is None else self.seq_len
        if self.seq_len < shortest:
            raise ValueError(f"seq_len={self.seq_len} < 2*num_pairs + 2*num_queries = {shortest}")


def draw(rng: np.random.Generator, n: int, cfg: PrepareConfig) -> np.ndarray:
    """n examples (n, seq_len): the pairs, the filler, then each query followed by its answer."""
    P, Q, K, V = cfg.num_pairs, cfg.num_queries, cfg.key_vocab, cfg.value_vocab
    rows = max(
        1, 2**22 // K
    )  # distinct keys: the P lowest of K random priorities, n * K of them in chunks of rows
    keys = np.concatenate(
        [
            np.argpartition(rng.random((min(rows, n - i), K)), P - 1, axis=1)[:, :P]
            for i in range(0, n, rows)
        ]
    )
    keys, values = rng.permuted(keys, axis=1), rng.integers(K, K + V, size=(n, P))
    asked = rng.random((n, P)).argsort(axis=1)[:, :Q]  # which pairs are queried, in query order
    ex = np.empty((n, cfg.seq_len), dtype=np.uint16)
    ex[:, : 2 * P : 2], ex[:, 1 : 2 * P : 2] = keys, values
    ex[:, 2 * P : -2 * Q] = rng.integers(K, K + V, size=(n, cfg.seq_len - 2 * P - 2 * Q))
    ex[:, -2 * Q :: 2] = np.take_along_axis(
        keys, asked, axis=1
    )  # the last 2Q tokens: queries and answers
    ex[:, 1 - 2 * Q :: 2] = np.take_along_axis(values, asked, axis=1)
    return ex


def unseen(
    rng: np.random.Generator, n: int, seen: set[bytes], cfg: PrepareConfig, split: str
) -> tuple[np.ndarray, int]:
    """n examples, none of them among seen (each's bytes), and how many draws were rejected as seen;
    a UserError after ROUNDS rounds of n draws without n such examples."""
    out, rejected = np.empty((0, cfg.seq_len), dtype=np.uint16), 0
    for _ in range(ROUNDS):
        more = draw(rng, n, cfg)
        new = np.array([row.tobytes() not in seen for row in more], dtype=bool)
        out, rejected = np.concatenate([out, more[new]])[:n], rejected + int((~new).sum())
        if len(out) == n:
            return out, rejected
    raise UserError(
        f"only {len(out)} of {n} {split} examples differ from every earlier split's example after "
        f"{ROUNDS} rounds: too few distinct examples; raise num_pairs, key_vocab or value_vocab"
    )


def main(cfg: PrepareConfig) -> None:
    rng = np.random.default_rng(cfg.seed)
    splits = {"train": draw(rng, cfg.train_examples, cfg)}
    seen = {row.tobytes() for row in splits["train"]}
    rejected = 0
    # val unlike train, then test unlike both (drawn after val: val is the same with or without it)
    held_out = {"val": cfg.val_examples, "test": cfg.test_examples}
    for split, n in [(split, n) for split, n in held_out.items() if n]:
        splits[split], more = unseen(rng, n, seen, cfg, split)
        seen |= {row.tobytes() for row in splits[split]}
        rejected += more
    mask = np.zeros(cfg.seq_len, dtype=np.uint8)
    mask[1 - 2 * cfg.num_queries :: 2] = 1  # the answers
    vocab = cfg.key_vocab + cfg.value_vocab
    names = tuple(f"{split}{kind}.bin" for split in splits for kind in ("", "_mask"))
    with writing_dataset(Path(cfg.out_dir), names) as (bins, meta):
        for split, examples in splits.items():
            bins[f"{split}.bin"].write(examples.tobytes())
            bins[f"{split}_mask.bin"].write(np.tile(mask, len(examples)).tobytes())
        meta.update(
            vocab_size=vocab,
            dtype="uint16",
            **{f"{split}_tokens": examples.size for split, examples in splits.items()},
            tokenizer="char",
            chars=[chr(0x4E00 + i) for i in range(vocab)],
            example_tokens=cfg.seq_len,
        )
    counts = ", ".join(f"{len(examples):,} {split}" for split, examples in splits.items())
    print(
        f"wrote {cfg.out_dir}: {counts} examples of {cfg.seq_len} tokens, vocab_size {vocab} "
        f"({rejected:,} held-out draws rejected as examples of an earlier split)"
    )


if __name__ == "__main__":
    run_cli(main, PrepareConfig)
