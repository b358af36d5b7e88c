"""mqar: multi-query associative recall (Zoology, Arora et al. 2023), made in code.

Zoology: https://arxiv.org/abs/2312.04927

Two layouts of seq_len tokens an example. 'compact' (the default): P key-value pairs
`k1 v1 ... kP vP`, seq_len - 2P - 2Q filler tokens, Q queries `q1 a1 ... qQ aQ`. Keys: distinct,
from the key vocabulary (ids 0..K-1); values and filler: from the value vocabulary (ids K..K+V-1),
with replacement; q_j: Q distinct keys of the example's P, in random order; a_j: q_j's value.
'zoology': Zoology's multiquery_ar, the paper's difficulty knobs (pairs, sequence length,
vocabulary, query gaps): P pairs of distinct keys and distinct values, then every key queried once,
each query in its own slot of two tokens after the pairs, the slots drawn without replacement with
p(g) proportional to g^(power_a - 1) for slot g = 1..(seq_len - 2P) / 2 (most queries soon after the
pairs, some far), every other token random over the whole vocabulary. Zoology hides the answer
from the input (a random token follows each query); here the answer follows its query, as in a
stream of next-token targets, where it shows only to later positions.

A mix of difficulties (Zoology's training mix, for capacity curves: docs/compare.md): with
--pairs_mix=[4,8,16,32] each example holds one of those pair counts (equal shares of every split,
in random order) and asks every key it holds, so its number of answers is its number of pairs;
num_pairs and num_queries are then the largest count (what needle and mqar_long build on).

The loss mask is 1 exactly at the answers; no val or test example equals a train example, and no
test example a val one (a learning rate chosen on val is measured on examples it never saw). Train
with --block_size=<seq_len - 1>. meta.json records the settings that made the dataset (`settings`:
every key but out_dir), which a script reusing it compares with its own (scripts/zoology_mqar.py).
"""

from dataclasses import asdict, dataclass, field, replace
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
    layout: str = "compact"  # or 'zoology' (queries at power-law gaps: Q = P, seq_len even)
    power_a: float = 0.01  # zoology: the query gaps' power law (Zoology's default)
    train_examples: int = 20000
    val_examples: int = 1000
    test_examples: int = 1000  # 0: no test split
    seed: int = 1337
    # a mix of pair counts, each example one of them with every key asked; []: num_pairs each
    pairs_mix: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.pairs_mix:
            self.check_mix()
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
        if self.layout not in ("compact", "zoology"):
            raise ValueError(f"layout={self.layout!r} must be 'compact' or 'zoology'")
        if self.layout == "zoology":
            self.check_zoology()

    def check_mix(self) -> None:
        """A mix of pair counts: positive, distinct, each example asking every key it holds (so
        num_queries is not given); num_pairs and num_queries become the largest count."""
        mix = self.pairs_mix
        if min(mix) <= 0 or len(set(mix)) != len(mix):
            raise ValueError(f"pairs_mix={mix}: pair counts must be positive and distinct")
        if self.num_queries is not None:
            raise ValueError(
                f"num_queries={self.num_queries} with pairs_mix={mix}: a mix's examples ask every "
                "key they hold (leave num_queries out)"
            )
        self.pairs_mix = sorted(mix)
        self.num_pairs = self.num_queries = max(mix)

    def check_zoology(self) -> None:
        """What Zoology's layout needs: every key queried, values distinct, whole query slots."""
        problems = []
        if self.num_queries != self.num_pairs:
            problems.append(
                f"num_queries={self.num_queries}: the zoology layout queries every key "
                f"(num_queries={self.num_pairs}, or leave it out)"
            )
        if self.value_vocab < self.num_pairs:
            problems.append(
                f"value_vocab={self.value_vocab} < num_pairs={self.num_pairs}: the zoology "
                "layout's values are distinct"
            )
        if self.seq_len % 2:
            problems.append(f"seq_len={self.seq_len}: the zoology layout needs an even length")
        if not self.power_a > 0:
            problems.append(f"power_a={self.power_a} must be positive")
        if problems:
            raise ValueError("; ".join(problems))


def distinct(rng: np.random.Generator, n: int, k: int, of: int) -> np.ndarray:
    """(n, k) ids, each row k distinct ones of 0..of-1 in random order: the k lowest of `of` random
    priorities, drawn in chunks of 2**22 priorities."""
    rows = max(1, 2**22 // of)
    chosen = np.concatenate(
        [
            np.argpartition(rng.random((min(rows, n - i), of)), k - 1, axis=1)[:, :k]
            for i in range(0, n, rows)
        ]
    )
    return rng.permuted(chosen, axis=1)


def draw(rng: np.random.Generator, n: int, cfg: PrepareConfig) -> tuple[np.ndarray, np.ndarray]:
    """n examples (n, seq_len) of cfg's layout and their loss masks (n, seq_len; 1 at the
    answers)."""
    if cfg.pairs_mix:
        return draw_mix(rng, n, cfg)
    if cfg.layout == "zoology":
        return draw_zoology(rng, n, cfg)
    P, Q, K, V = cfg.num_pairs, cfg.num_queries, cfg.key_vocab, cfg.value_vocab
    keys, values = distinct(rng, n, P, K), rng.integers(K, K + V, size=(n, P))
    asked = rng.random((n, P)).argsort(axis=1)[:, :Q]  # which pairs are queried, in query order
    ex = np.empty((n, cfg.seq_len), dtype=np.uint16)
    ex[:, : 2 * P : 2], ex[:, 1 : 2 * P : 2] = keys, values
    ex[:, 2 * P : -2 * Q] = rng.integers(K, K + V, size=(n, cfg.seq_len - 2 * P - 2 * Q))
    ex[:, -2 * Q :: 2] = np.take_along_axis(
        keys, asked, axis=1
    )  # the last 2Q tokens: queries and answers
    ex[:, 1 - 2 * Q :: 2] = np.take_along_axis(values, asked, axis=1)
    mask = np.zeros((n, cfg.seq_len), dtype=np.uint8)
    mask[:, 1 - 2 * Q :: 2] = 1  # the answers
    return ex, mask


def draw_mix(rng: np.random.Generator, n: int, cfg: PrepareConfig) -> tuple[np.ndarray, np.ndarray]:
    """n examples of cfg's pair counts in equal shares (the first counts one more where n does not
    divide), every key of each asked, in random order."""
    shares = np.array_split(np.arange(n), len(cfg.pairs_mix))
    parts = [
        draw(rng, len(share), replace(cfg, pairs_mix=[], num_pairs=P, num_queries=P))
        for P, share in zip(cfg.pairs_mix, shares, strict=True)
    ]
    order = rng.permutation(n)
    return np.concatenate([ex for ex, _ in parts])[order], np.concatenate([m for _, m in parts])[
        order
    ]


def query_slots(rng: np.random.Generator, n: int, cfg: PrepareConfig) -> np.ndarray:
    """(n, P) distinct slots of the zoology layout's (seq_len - 2P) / 2, in random order, each row
    drawn without replacement with p(slot g - 1) proportional to g^(power_a - 1) (Gumbel top-k:
    the P largest log p + Gumbel noise are such a draw)."""
    P = cfg.num_pairs
    space = (cfg.seq_len - 2 * P) // 2
    log_p = (cfg.power_a - 1) * np.log(np.arange(1, space + 1))
    scores = log_p - np.log(-np.log(rng.random((n, space))))
    return rng.permuted(np.argpartition(-scores, P - 1, axis=1)[:, :P], axis=1)


def draw_zoology(
    rng: np.random.Generator, n: int, cfg: PrepareConfig
) -> tuple[np.ndarray, np.ndarray]:
    """Zoology's layout (the module's docstring): random tokens, the pairs at the start, each key
    then queried in its slot with its answer after it."""
    P, K, V = cfg.num_pairs, cfg.key_vocab, cfg.value_vocab
    keys, values = distinct(rng, n, P, K), K + distinct(rng, n, P, V)
    ex = rng.integers(0, K + V, size=(n, cfg.seq_len)).astype(np.uint16)
    ex[:, : 2 * P : 2], ex[:, 1 : 2 * P : 2] = keys, values
    at = 2 * P + 2 * query_slots(rng, n, cfg)  # the queries' positions
    np.put_along_axis(ex, at, keys, axis=1)
    np.put_along_axis(ex, at + 1, values, axis=1)
    mask = np.zeros((n, cfg.seq_len), dtype=np.uint8)
    np.put_along_axis(mask, at + 1, 1, axis=1)
    return ex, mask


def key(example: np.ndarray, mask: np.ndarray) -> bytes:
    """What tells two examples apart: their tokens and which of them are answers."""
    return example.tobytes() + mask.tobytes()


def unseen(
    rng: np.random.Generator, n: int, seen: set[bytes], cfg: PrepareConfig, split: str
) -> tuple[np.ndarray, np.ndarray, int]:
    """n examples and their masks, none among seen (each's bytes, mask's after its tokens'), and how
    many draws were rejected as seen; a UserError after ROUNDS rounds of n draws without n such
    examples."""
    out = np.empty((0, cfg.seq_len), dtype=np.uint16)
    masks, rejected = np.empty((0, cfg.seq_len), dtype=np.uint8), 0
    for _ in range(ROUNDS):
        more, more_masks = draw(rng, n, cfg)
        new = np.array([key(*row) not in seen for row in zip(more, more_masks)], dtype=bool)
        out = np.concatenate([out, more[new]])[:n]
        masks = np.concatenate([masks, more_masks[new]])[:n]
        rejected += int((~new).sum())
        if len(out) == n:
            return out, masks, rejected
    raise UserError(
        f"only {len(out)} of {n} {split} examples differ from every earlier split's example after "
        f"{ROUNDS} rounds: too few distinct examples; raise num_pairs, key_vocab or value_vocab"
    )


def main(cfg: PrepareConfig) -> None:
    rng = np.random.default_rng(cfg.seed)
    splits = {"train": draw(rng, cfg.train_examples, cfg)}
    seen = {key(*row) for row in zip(*splits["train"])}
    rejected = 0
    # val unlike train, then test unlike both (drawn after val: val is the same with or without it)
    held_out = {"val": cfg.val_examples, "test": cfg.test_examples}
    for split, n in [(split, n) for split, n in held_out.items() if n]:
        examples, masks, more = unseen(rng, n, seen, cfg, split)
        splits[split] = examples, masks
        seen |= {key(*row) for row in zip(examples, masks)}
        rejected += more
    vocab = cfg.key_vocab + cfg.value_vocab
    names = tuple(f"{split}{kind}.bin" for split in splits for kind in ("", "_mask"))
    with writing_dataset(Path(cfg.out_dir), names) as (bins, meta):
        for split, (examples, masks) in splits.items():
            bins[f"{split}.bin"].write(examples.tobytes())
            bins[f"{split}_mask.bin"].write(masks.tobytes())
        meta.update(
            vocab_size=vocab,
            dtype="uint16",
            **{f"{split}_tokens": examples.size for split, (examples, _) in splits.items()},
            tokenizer="char",
            chars=[chr(0x4E00 + i) for i in range(vocab)],
            example_tokens=cfg.seq_len,
            # what made it: a script that reuses the dataset checks them (scripts/zoology_mqar.py)
            settings={k: v for k, v in asdict(cfg).items() if k != "out_dir"},
        )
    counts = ", ".join(f"{len(examples):,} {split}" for split, (examples, _) in splits.items())
    print(
        f"wrote {cfg.out_dir}: {counts} examples of {cfg.seq_len} tokens, vocab_size {vocab} "
        f"({rejected:,} held-out draws rejected as examples of an earlier split)"
    )


if __name__ == "__main__":
    run_cli(main, PrepareConfig)
