"""data/mqar/prepare.py: the MQAR task (Zoology) as files, checked by parsing every example back,
through dataset.Batches, and by a short training run."""

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import cli, read_log, run
from smallgpt import runlog
from smallgpt.checkpoint import load_run, parse_source
from smallgpt.data import Batches, load_meta, open_tokens
from smallgpt.errors import UserError
from smallgpt.tokenizer import load_tokenizer

SCRIPT = "data/mqar/prepare.py"
FILES = (
    *(f"{split}{kind}.bin" for split in ("train", "val", "test") for kind in ("", "_mask")),
    "meta.json",
)
# P=6 pairs, Q=4 queries (fewer than P), 30 tokens (10 of them filler), keys 0..15, values 16..25
TASK = dict(num_pairs=6, num_queries=4, key_vocab=16, value_vocab=10, seq_len=30)
P, Q, K, V, L = TASK.values()


def prepare(out: Path, *flags: str, **knobs: int) -> str:
    """Run the real prepare script (400 train, 100 val and 100 test examples unless knobs say
    otherwise); its stdout."""
    knobs = dict(train_examples=400, val_examples=100, test_examples=100) | knobs
    return run(
        [SCRIPT, f"--out_dir={out}", *flags, *(f"--{k}={v}" for k, v in knobs.items())]
    ).stdout


def examples(out: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """A split's examples and their masks, one row each: (n, example_tokens)."""
    meta = load_meta(out)
    n = meta["example_tokens"]
    return (
        np.asarray(open_tokens(out, split, meta)).reshape(-1, n).astype(np.int64),
        np.asarray(open_tokens(out, split, meta, mask=True)).reshape(-1, n),
    )


def tiny_run(data: Path, block_size: int, out: Path, max_iters: int, *more: str) -> list[str]:
    """train.py's command for a tiny run on the MQAR dataset at data: one layer of 32, float32 on
    the CPU, an evaluation every 2 iterations, then more flags."""
    return [
        "train.py",
        f"--dataset={data}",
        f"--block_size={block_size}",
        "--n_layer=1",
        "--n_head=2",
        "--n_embd=32",
        f"--max_iters={max_iters}",
        "--eval_interval=2",
        "--eval_iters=2",
        "--batch_size=4",
        "--device=cpu",
        "--dtype=float32",
        f"--out_dir={out}",
        *more,
    ]


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mqar")
    prepare(out, **TASK)
    return out


def test_splits_are_disjoint_and_meta_is_as_asked(task: Path, tmp_path: Path) -> None:
    meta = load_meta(task)  # meta_problems finds nothing wrong
    assert meta["vocab_size"] == K + V and meta["dtype"] == "uint16" and meta["tokenizer"] == "char"
    assert (
        meta["example_tokens"] == L
        and meta["train_tokens"] == 400 * L
        and meta["val_tokens"] == 100 * L
        and meta["test_tokens"] == 100 * L
    )
    assert meta["chars"] == [chr(0x4E00 + i) for i in range(K + V)]
    # every setting that made it, resolved (a script reusing it compares them), out_dir aside
    made = dict(TASK, layout="compact", power_a=0.01, seed=1337)
    made |= dict(train_examples=400, val_examples=100, test_examples=100, pairs_mix=[])
    assert meta["settings"] == made
    train, val, test = (examples(task, split)[0] for split in ("train", "val", "test"))
    assert train.shape == (400, L) and val.shape == (100, L) and test.shape == (100, L)
    rows = [{row.tobytes() for row in split} for split in (train, val, test)]
    assert not rows[0] & rows[1] and not rows[0] & rows[2] and not rows[1] & rows[2]
    text = load_tokenizer(meta).decode(
        val[0].tolist()
    )  # samples decode as CJK characters, one a token
    assert len(text) == L and load_tokenizer(meta).encode(text) == val[0].tolist()
    # a task of 216 distinct examples (4*3 key orders, 3*3 values, 2 queries): 400 train draws hold
    # most of them
    small = tmp_path / "small"
    knobs = dict(num_pairs=2, num_queries=1, key_vocab=4, value_vocab=3)
    printed = prepare(small, **knobs, val_examples=20, test_examples=20)
    rejected = int(re.search(r"\(([\d,]+) held-out draws rejected", printed)[1].replace(",", ""))
    train, val, test = (examples(small, split)[0] for split in ("train", "val", "test"))
    rows = [{row.tobytes() for row in split} for split in (train, val, test)]
    assert rejected > 40 and len(val) == len(test) == 20
    assert not rows[0] & rows[1] and not rows[0] & rows[2] and not rows[1] & rows[2]
    # without a test split, val is the same examples: test is drawn after it
    prepare(tmp_path / "no-test", **knobs, val_examples=20, test_examples=0)
    assert "test_tokens" not in load_meta(tmp_path / "no-test")
    assert np.array_equal(examples(tmp_path / "no-test", "val")[0], val)


def test_every_answer_is_the_value_of_its_query_key(task: Path) -> None:
    first_query_is_first_pair = 0
    for split in ("train", "val"):
        ids, mask = examples(task, split)
        for row, row_mask in zip(ids, mask, strict=True):
            keys, values = row[: 2 * P : 2], row[1 : 2 * P : 2]
            queries, answers = row[L - 2 * Q :: 2], row[L - 2 * Q + 1 :: 2]
            assert (
                len(set(keys)) == P
                and keys.max() < K
                and values.min() >= K
                and values.max() < K + V
            )
            assert (
                row[2 * P : L - 2 * Q].min() >= K and row[2 * P : L - 2 * Q].max() < K + V
            )  # filler: values
            assert len(set(queries)) == Q and set(queries) <= set(keys)
            assert answers.tolist() == [dict(zip(keys, values, strict=True))[q] for q in queries]
            assert np.flatnonzero(row_mask).tolist() == list(range(L - 2 * Q + 1, L, 2))
            first_query_is_first_pair += int(queries[0] == keys[0])
    assert (
        first_query_is_first_pair < 0.5 * 500
    )  # queries come in random order (1/P of them by chance)


def test_a_mix_of_pair_counts_asks_every_key_in_equal_shares(tmp_path: Path) -> None:
    prepare(tmp_path, "--pairs_mix=[5,2,3]", key_vocab=16, value_vocab=10, seq_len=24)
    settings = load_meta(tmp_path)["settings"]
    assert settings["pairs_mix"] == [2, 3, 5]
    assert settings["num_pairs"] == settings["num_queries"] == 5  # what needle and mqar_long read
    for split, n in (("train", 400), ("val", 100), ("test", 100)):
        ids, mask = examples(tmp_path, split)
        pairs = mask.sum(1)  # every key asked: as many answers as pairs
        # equal shares, the first counts one more where 3 does not divide n
        shares = [n // 3 + (i < n % 3) for i in range(3)]
        assert [int((pairs == p).sum()) for p in (2, 3, 5)] == shares
        for row, row_mask, p in zip(ids, mask, pairs, strict=True):
            keys, values = row[: 2 * p : 2], row[1 : 2 * p : 2]
            queries, answers = row[24 - 2 * p :: 2], row[24 - 2 * p + 1 :: 2]
            assert len(set(keys)) == p and keys.max() < 16 and values.min() >= 16
            assert sorted(queries) == sorted(keys)  # each key once
            assert answers.tolist() == [dict(zip(keys, values, strict=True))[q] for q in queries]
            assert np.flatnonzero(row_mask).tolist() == list(range(24 - 2 * p + 1, 24, 2))
        assert len(set(pairs[:30].tolist())) > 1  # the counts are shuffled, not in blocks


def test_training_stops_early_at_the_accuracy_and_that_evaluation_is_final(tmp_path: Path) -> None:
    """stop_at_accuracy=0 is reached at the first evaluation after a step: the run stops there,
    measures the test split and its final evals, saves, and a resume trains no further."""
    data = tmp_path / "mix"
    prepare(data, "--pairs_mix=[2,4]", key_vocab=16, value_vocab=10, seq_len=16)
    out = tmp_path / "run"
    flags = tiny_run(data, 15, out, 8, "--final_evals=[mqar]", "--stop_at_accuracy=0")
    assert "stopping early" in run(flags).stdout
    log = read_log(out)
    assert [(r["event"], r["iter"]) for r in log if r["event"] != "config"] == [
        ("eval", 0),
        ("stop", 2),
        ("eval", 2),
        ("recall", 2),
    ]
    final = [r for r in log if r["event"] == "eval"][-1]
    assert "test_loss" in final and [c["pairs"] for c in final["val_mqar"]["by_pairs"]] == [2, 4]
    (recall,) = [r for r in log if r["event"] == "recall"]
    by_pairs = recall["mqar"]["by_pairs"]
    assert sum(c["correct"] for c in by_pairs) == recall["mqar"]["correct"]
    ckpt = torch.load(out / "ckpt.pt", map_location="cpu", weights_only=False)
    assert ckpt["iter_num"] == 2 and ckpt["stopped_early"]
    assert runlog.unfinished(runlog.read_run(out), final_iter=8) is None  # finished, at 2
    again = run([*flags, "--init_from=resume"])
    assert "stopped early at iteration 2" in again.stdout and read_log(out) == log


def test_a_sweep_judging_solved_at_its_stop_says_so_up_front(tmp_path: Path) -> None:
    """A run stops as soon as its val accuracy reaches stop_at_accuracy, so a solved_threshold at or
    above it judges the stopped runs by the splits' noise: the plan says so, and not below it."""
    data = tmp_path / "mix"
    prepare(data, "--pairs_mix=[2,4]", key_vocab=16, value_vocab=10, seq_len=16)
    sweep = ["compare.py", *tiny_run(data, 15, tmp_path / "cmp", 8)[1:], "--seeds=1"]
    sweep += ["--stop_at_accuracy=0.95", "--mode=plan"]
    said = "solved_threshold=0.95 is at or above stop_at_accuracy=0.95: a run stops as soon"
    assert said in run([*sweep, "--solved_threshold=0.95"]).stdout
    assert "solved_threshold" not in run(sweep).stdout  # the default, 0.9


def test_the_zoology_layout_queries_every_key_once_at_power_law_gaps(tmp_path: Path) -> None:
    """layout=zoology: the pairs first (distinct keys, distinct values), then each key queried once
    in a slot of two tokens with its value after it, the answers the only targets; with one pair,
    the slot's frequency is p(g) = g^(a - 1) / sum over the (seq_len - 2) / 2 slots, by hand."""
    P, L, K, V = 4, 24, 16, 12
    prepare(tmp_path / "z", layout="zoology", num_pairs=P, seq_len=L, key_vocab=K, value_vocab=V)
    for split in ("train", "val", "test"):
        ids, mask = examples(tmp_path / "z", split)
        for row, row_mask in zip(ids, mask, strict=True):
            keys, values = row[: 2 * P : 2], row[1 : 2 * P : 2]
            assert len(set(keys)) == P and keys.max() < K and len(set(values)) == P
            assert values.min() >= K and values.max() < K + V
            answers = np.flatnonzero(row_mask)
            assert len(answers) == P and all((answers - 2 * P) % 2 == 1) and answers.min() > 2 * P
            asked = row[answers - 1]
            assert sorted(asked) == sorted(keys)
            pairs = dict(zip(keys, values, strict=True))
            assert row[answers].tolist() == [pairs[q] for q in asked]
    a, slots = 0.01, (L - 2) // 2
    prepare(
        tmp_path / "one",
        layout="zoology",
        num_pairs=1,
        seq_len=L,
        key_vocab=K,
        value_vocab=V,
        train_examples=20000,
    )
    _, mask = examples(tmp_path / "one", "train")
    slot = (np.argmax(mask, axis=1) - 3) // 2  # the answer after slot g - 1 sits at 2 + 2(g-1) + 1
    p = np.arange(1, slots + 1) ** (a - 1.0)
    p /= p.sum()
    seen = np.bincount(slot, minlength=slots) / len(slot)
    assert seen == pytest.approx(p, abs=0.015)  # 20,000 draws: a standard error under 0.004
    assert p[0] > 1.9 * p[1] > 0  # the first slot the likeliest, 2^0.99 times the second


def test_batches_target_the_answers_only(task: Path) -> None:
    batches = Batches(task, block_size=L - 1, batch_size=8, seed=0, device="cpu")
    for x, y in (batches.train(0, 0), batches.eval("val", 0)):
        assert x.shape == y.shape == (8, L - 1)
        at_queries = list(
            range(L - 2 * Q, L - 1, 2)
        )  # target t is token t + 1: the answer after each query
        assert (y[:, [t for t in range(L - 1) if t not in at_queries]] == -1).all()
        for row, targets in zip(x.tolist(), y.tolist(), strict=True):
            pairs = dict(zip(row[: 2 * P : 2], row[1 : 2 * P : 2], strict=True))
            assert [targets[t] for t in at_queries] == [pairs[row[t]] for t in at_queries]
    with pytest.raises(UserError, match=f"block_size={L - 1}") as e:
        Batches(task, block_size=L, batch_size=8, seed=0, device="cpu")
    assert "\n" not in str(e.value)


def test_the_same_seed_gives_the_same_files(tmp_path: Path) -> None:
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        prepare(tmp_path / name, seed=seed, **TASK)
    a, b, c = ({f: (tmp_path / name / f).read_bytes() for f in FILES} for name in "abc")
    assert a == b
    assert a["train.bin"] != c["train.bin"] and a["val.bin"] != c["val.bin"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num_queries=9"], "num_queries=9 > num_pairs=8"),
        (["--key_vocab=7"], "key_vocab=7 < num_pairs=8"),
        (["--seq_len=31"], "seq_len=31 < 2*num_pairs + 2*num_queries = 32"),
        (["--num_pairs=0"], "num_pairs=0"),
        (["--num_queries=0"], "num_queries=0"),
        (["--value_vocab=-1"], "value_vocab=-1"),
        (["--train_examples=0"], "train_examples=0"),
        (["--val_examples=0"], "val_examples=0"),
        (["--test_examples=-1"], "test_examples=-1 must be 0 or more"),
        (["--layout=zoo"], "layout='zoo' must be 'compact' or 'zoology'"),
        (["--layout=zoology", "--num_queries=4"], "the zoology layout queries every key"),
        (["--layout=zoology", "--seq_len=33"], "the zoology layout needs an even length"),
        (["--layout=zoology", "--value_vocab=7"], "the zoology layout's values are distinct"),
        (["--layout=zoology", "--power_a=0"], "power_a=0.0 must be positive"),
        (["--pairs_mix=[2,2]"], "pairs_mix=[2, 2]: pair counts must be positive and distinct"),
        (["--pairs_mix=[0,2]"], "pair counts must be positive"),
        (["--pairs_mix=[2,4]", "--num_queries=2"], "a mix's examples ask every key they hold"),
        (["--pairs_mix=[2,8]", "--seq_len=31"], "seq_len=31 < 2*num_pairs + 2*num_queries = 32"),
        (["--key_vocab=10000", "--value_vocab=10001"], "key_vocab + value_vocab = 20001 > 20000"),
        (
            ["--num_pairs=1", "--key_vocab=1", "--value_vocab=1"],
            "too few distinct examples",
        ),  # one possible example
    ],
)
def test_bad_knobs_are_one_line_and_write_nothing(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    out = tmp_path / "mqar"
    r = cli([SCRIPT, f"--out_dir={out}", "--train_examples=50", "--val_examples=10", *flags])
    assert (
        r.returncode == 2 and r.stderr.startswith("error: ") and len(r.stderr.splitlines()) == 1
    ), r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


def test_train_py_trains_on_it(task: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    flags = ["--final_evals=[mqar,position]", "--always_save_checkpoint=True"]
    run(tiny_run(task, L - 1, out, 4, *flags))
    log = read_log(out)
    evals = [r for r in log if r["event"] == "eval"]
    assert [r["iter"] for r in evals] == [0, 2, 4] and all(
        math.isfinite(r["val_loss"]) for r in evals
    )
    assert (
        abs(evals[0]["val_loss"] - math.log(K + V)) < 1.0
    )  # answers only: about ln(vocab) at initialisation
    # the test split at the final evaluation only, and MQAR's accuracy on it: computed here from
    # the saved model on the test examples' evaluation batches
    assert ["test_loss" in r for r in evals] == [False, False, True]
    model = load_run(parse_source("resume"), str(out), "cpu").model.eval()
    batches = Batches(task, L - 1, 4, 1337, "cpu")
    losses, correct, by_position = [], 0, []
    with torch.no_grad():
        for k in range(2):
            idx, targets = batches.eval("test", k)
            logits, loss = model(idx, targets)  # with targets: every position's logits
            losses.append(loss.item())
            correct += int(((logits.argmax(-1) == targets) & (targets >= 0)).sum())
            each = torch.nn.functional.cross_entropy(
                logits.transpose(1, 2), targets.clamp(min=0), reduction="none"
            )
            by_position.append(torch.where(targets >= 0, each, torch.nan))
    assert evals[-1]["test_loss"] == pytest.approx(sum(losses) / 2, rel=1e-6)
    assert evals[-1]["test_loss"] != evals[-1]["val_loss"]
    (recall,) = [r for r in log if r["event"] == "recall"]
    assert recall["split"] == "test" and recall["mqar"]["correct"] == correct
    answers = torch.cat(by_position).nanmean(0)[1 - 2 * Q :: 2]  # each answer position's loss
    assert recall["position"][1 - 2 * Q :: 2] == pytest.approx(answers.tolist(), rel=1e-5)


def test_a_damaged_example_length_or_a_missing_mask_is_one_line(task: Path, tmp_path: Path) -> None:
    import json
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(task, damaged)
    meta = json.loads((damaged / "meta.json").read_text())
    (damaged / "meta.json").write_text(
        json.dumps(meta | {"example_tokens": L + 1})
    )  # divides no split
    with pytest.raises(
        UserError,
        match=f"example_tokens is {L + 1}, not a whole number above 1 that divides every split",
    ):
        Batches(damaged, L, 4, 0, "cpu")
    (damaged / "meta.json").write_text(json.dumps(meta))
    (damaged / "test_mask.bin").unlink()
    with pytest.raises(UserError, match="test_mask.bin is missing; prepare the dataset again"):
        Batches(damaged, L - 1, 4, 0, "cpu")
    (damaged / "val_mask.bin").unlink()
    with pytest.raises(UserError, match="val_mask.bin is missing; prepare the dataset again"):
        Batches(damaged, L - 1, 4, 0, "cpu")
