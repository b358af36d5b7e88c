"""smallgpt/recall.py's evaluations against hand-built oracles: a model that copies perfectly scores
100% on induction and one that knows nothing scores chance; loss by position averages to the val
loss; train.py --final_evals logs them, eval.py prints them, and bad input is one line."""

import json
import math
import shutil
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import TINY_TRAIN, cli, read_log, run, tiny_model
from smallgpt import recall
from smallgpt.checkpoint import load_checkpoint, save_checkpoint
from smallgpt.configs import TrainConfig
from smallgpt.data import Batches
from smallgpt.errors import UserError
from smallgpt.measure import evaluate
from smallgpt.runlog import read_run, unfinished


class Copier(torch.nn.Module):
    """An induction oracle: at each position, all its weight on the token that followed the last
    earlier occurrence of the current token (uniform where there is none), as GPT's forward returns
    logits with targets given."""

    def __init__(self, vocab: int, block_size: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.config = SimpleNamespace(block_size=block_size)
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # where the evaluation puts its inputs

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, None]:
        B, T = idx.shape
        logits = torch.zeros(B, T, self.vocab)
        for b in range(B):
            seen: dict[int, int] = {}  # token -> the token that followed its last occurrence
            row = idx[b].tolist()
            for t, token in enumerate(row):
                if token in seen:
                    logits[b, t, seen[token]] = 30.0
                if t + 1 < T:
                    seen[token] = row[t + 1]
        return logits, None


class Uniform(Copier):
    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, None]:
        return torch.zeros(*idx.shape, self.vocab), None


def test_a_perfect_copier_scores_everything_and_a_uniform_model_scores_chance() -> None:
    V, L = 64, 8
    perfect = recall.induction(Copier(V, 64), V, [8, 24, 56], length=L, examples=40, batch_size=16)
    assert [r["distance"] for r in perfect] == [8, 24, 56]
    assert all(
        r["accuracy"] == 1.0 and r["loss"] < 1e-6 and r["n"] == 40 * (L - 1) for r in perfect
    )
    chance = recall.induction(Uniform(V, 64), V, [24], length=L, examples=256, batch_size=64)[0]
    assert chance["loss"] == pytest.approx(math.log(V), rel=1e-6)
    assert (
        chance["accuracy"] < 4 / V
    )  # argmax of a flat row is token 0: right 1 time in V, give or take
    again = recall.induction(Uniform(V, 64), V, [24], length=L, examples=256, batch_size=64)[0]
    assert again == chance  # seeded


def test_induction_batches_repeat_a_segment_of_distinct_tokens_at_the_distance() -> None:
    idx, targets = recall.induction_batch(
        np.random.default_rng(0), 8, vocab=40, length=6, distance=20
    )
    assert idx.shape == targets.shape == (8, 25)
    for b in range(8):
        segment = idx[b, :6].tolist()
        assert len(set(segment)) == 6 and not set(idx[b, 6:20].tolist()) & set(
            segment
        )  # filler: other tokens
        counted = (targets[b] >= 0).nonzero().flatten().tolist()
        assert counted == list(range(20, 25))  # the copy's tokens after its first
        assert [targets[b, t].item() for t in counted] == segment[
            1:
        ]  # each one the token `distance` back


def test_loss_by_position_averages_to_the_val_loss(pycode_small: Path) -> None:
    batches = Batches(pycode_small, 32, 4, 1337, "cpu")
    model = tiny_model(vocab_size=batches.meta["vocab_size"]).eval()
    curve = recall.loss_by_position(model, batches, eval_iters=3)
    assert len(curve) == 32 and sum(curve) / 32 == pytest.approx(
        evaluate(model, batches, 3, nullcontext())["val"]
    )
    by_hand = []  # position 5 alone, from the model's logits
    for k in range(3):
        idx, targets = batches.eval("val", k)
        logits, _ = model(idx, targets)
        by_hand.append(
            torch.nn.functional.cross_entropy(logits[:, 5], targets[:, 5], reduction="none")
        )
    assert curve[5] == pytest.approx(torch.cat(by_hand).mean().item(), rel=1e-5)


def test_distances_past_the_context_and_vocabularies_too_small_are_one_line() -> None:
    with pytest.raises(UserError, match="between 8 and block_size - 8 = 24"):
        recall.induction(Copier(64, 32), 64, [25], length=8)
    with pytest.raises(UserError, match="needs 32 distinct tokens .* the vocabulary has 20"):
        recall.induction(Copier(20, 64), 20, [16], length=16)
    assert recall.default_distances(256, 16) == [16, 32, 64, 128, 240]
    assert recall.default_distances(32, 8) == [8, 16, 24]


def test_train_logs_its_final_evals_and_eval_py_prints_the_same(
    pycode_small: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    r = run(
        [
            "train.py",
            f"--dataset={pycode_small}",
            f"--out_dir={out}",
            *TINY_TRAIN,
            "--max_iters=10",
            "--eval_interval=10",
            "--final_evals=[induction,position]",
        ]
    )
    assert "step 10: induction acc" in r.stdout
    record = [x for x in read_log(out) if x["event"] == "recall"]
    assert len(record) == 1 and record[0]["iter"] == 10
    assert [d["distance"] for d in record[0]["induction"]] == [8, 16, 24] and len(
        record[0]["position"]
    ) == 32
    assert (
        read_run(out)["recall"]["induction"] == record[0]["induction"]
        and unfinished(read_run(out)) is None
    )
    # eval.py on the checkpoint: the same tasks and settings give the same numbers (the final model
    # was saved)
    base = [
        "eval.py",
        f"--out_dir={out}",
        "--device=cpu",
        "--progress=False",
        "--induction_length=8",
        "--eval_iters=4",
        "--batch_size=8",
        "--seed=1337",
    ]
    r = cli([*base, "--tasks=[induction,position]"])
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [x["distance"] for x in rows if x["task"] == "induction"] == [8, 16, 24]
    assert [x for x in rows if x["task"] == "induction"] == [
        {"task": "induction", **d} for d in record[0]["induction"]
    ]
    assert next(x for x in rows if x["task"] == "position")["loss"] == pytest.approx(
        record[0]["position"]
    )
    # the same model exported to a transformers folder and read back by init_from=hf: scores the
    # same
    run(["export.py", f"--out_dir={out}", f"--to={tmp_path / 'hf'}"])
    r = cli([*base, f"--init_from=hf:{tmp_path / 'hf'}", f"--dataset={pycode_small}"])
    assert r.returncode == 0, r.stderr
    from_hf = [json.loads(line) for line in r.stdout.splitlines()]
    assert [x["correct"] for x in from_hf if x["task"] == "induction"] == [
        d["correct"] for d in record[0]["induction"]
    ]
    assert from_hf[-1]["loss"] == pytest.approx(record[0]["position"], rel=1e-4)
    # mistakes: one line each
    for flags, message in [
        (["--distances=[30]"], "induction distance 30 with induction_length=8"),
        (["--induction_length=64"], "induction_length=64 needs 128 distinct tokens"),
        (["--tasks=[induction,mqar]"], "the mqar task reads an MQAR dataset"),
        (["--tasks=[recall]"], "tasks: 'recall' is not one of induction, position, mqar"),
    ]:
        r = cli([*base, *flags])
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr
    # a run killed before its final evals were logged is not finished (the sweep runs it again)
    log = out / "log.jsonl"
    log.write_text(
        "".join(line + "\n" for line in log.read_text().splitlines() if '"recall"' not in line)
    )
    assert unfinished(read_run(out)) == "its final_evals are not logged yet (killed while they ran)"


def test_mqar_accuracy_is_one_for_a_model_that_looks_keys_up_and_chance_for_a_uniform_one(
    tmp_path: Path,
) -> None:
    """On a prepared MQAR dataset the copier (the token after the key's earlier occurrence: its
    value) answers every query; a uniform model, whose top token is the first id (a key, never an
    answer), none."""
    run(
        [
            "data/mqar/prepare.py",
            f"--out_dir={tmp_path}",
            "--train_examples=200",
            "--val_examples=200",
        ]
    )
    batches = Batches(tmp_path, 31, 16, 0, "cpu")
    perfect = recall.mqar(Copier(128, 31), batches, eval_iters=4)
    assert perfect == {"accuracy": 1.0, "correct": 4 * 16 * 8, "n": 4 * 16 * 8}
    assert recall.mqar(Uniform(128, 31), batches, eval_iters=4)["accuracy"] == 0.0


class FewKeys(Copier):
    """The copier on examples of at most `most` pairs (their distinct keys, ids below 16), the
    uniform model's first id (a key: never an answer) on the others."""

    def __init__(self, vocab: int, block_size: int, most: int) -> None:
        super().__init__(vocab, block_size)
        self.most = most

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, None]:
        logits, _ = super().forward(idx, targets)
        many = torch.tensor([len(set(row[row < 16].tolist())) > self.most for row in idx])
        return logits.masked_fill(many[:, None, None], 0.0), None


def test_mqar_accuracy_by_pair_count_on_a_mix(tmp_path: Path) -> None:
    """On a mix of 2 and 4 pairs, a model that recalls only examples of at most 2 pairs scores 1
    there and 0 at 4; the whole accuracy is the share of answers in examples of 2 pairs."""
    data = ["data/mqar/prepare.py", f"--out_dir={tmp_path}", "--pairs_mix=[2,4]"]
    run([*data, "--key_vocab=16", "--value_vocab=10", "--seq_len=16", "--val_examples=100"])
    batches = Batches(tmp_path, 15, 16, 0, "cpu")
    got = recall.mqar(FewKeys(26, 15, most=2), batches, eval_iters=3)
    asked = torch.cat([batches.eval("val", k)[1] for k in range(3)]) >= 0
    two = asked.sum(1) == 2  # the examples of 2 pairs: 2 answers
    n2, n4 = 2 * int(two.sum()), 4 * int((~two).sum())
    assert got["by_pairs"] == [
        {"pairs": 2, "accuracy": 1.0, "correct": n2, "n": n2},
        {"pairs": 4, "accuracy": 0.0, "correct": 0, "n": n4},
    ]
    assert got["accuracy"] == n2 / (n2 + n4) and 0 < n2 and 0 < n4
    assert recall.flat({"mqar": got})["mqar_acc@4"] == 0.0


def eval_rows(args: list[str]) -> list[dict]:
    """eval.py's JSON lines for args (which must succeed)."""
    r = cli(["eval.py", "--device=cpu", "--progress=False", *args])
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()]


def test_eval_py_with_no_settings_prints_exactly_what_the_run_logged(
    pycode_small: Path, tmp_path: Path
) -> None:
    """Its tasks, batch_size, eval_iters, seed, dtype and induction segment are the run's (its
    --final_evals'): the same numbers, equal, not close (fp32 on CPU)."""
    out = tmp_path / "run"
    run(
        [
            "train.py",
            f"--dataset={pycode_small}",
            f"--out_dir={out}",
            *TINY_TRAIN,
            "--max_iters=4",
            "--eval_interval=4",
            "--seed=7",
            "--final_evals=[induction,position]",
            "--always_save_checkpoint=True",
        ]
    )  # the final model is the one saved
    logged = next(x for x in read_log(out) if x["event"] == "recall")
    for tasks in ([], ["--tasks=[induction,position]"]):  # left out: the run's final_evals
        rows = eval_rows([f"--out_dir={out}", *tasks])
        assert [x for x in rows if x["task"] == "induction"] == [
            {"task": "induction", **d} for d in logged["induction"]
        ]
        assert next(x for x in rows if x["task"] == "position")["loss"] == logged["position"]


def test_eval_py_with_no_settings_prints_the_mqar_accuracy_the_run_logged(tmp_path: Path) -> None:
    data = tmp_path / "mqar"
    run(["data/mqar/prepare.py", f"--out_dir={data}", "--train_examples=200", "--val_examples=100"])
    out = tmp_path / "run"
    run(
        [
            "train.py",
            f"--dataset={data}",
            f"--out_dir={out}",
            "--block_size=31",
            "--n_layer=1",
            "--n_head=2",
            "--n_embd=32",
            "--max_iters=4",
            "--eval_interval=4",
            "--eval_iters=3",
            "--batch_size=5",
            "--device=cpu",
            "--dtype=float32",
            "--final_evals=[mqar,position]",
            "--always_save_checkpoint=True",
        ]
    )
    logged = next(x for x in read_log(out) if x["event"] == "recall")
    rows = eval_rows([f"--out_dir={out}"])
    assert next(x for x in rows if x["task"] == "mqar") == {"task": "mqar", **logged["mqar"]}
    assert next(x for x in rows if x["task"] == "position")["loss"] == logged["position"]
    # the run measured its test split (the dataset has one); --split=val the other
    assert logged["split"] == "test"
    rows = eval_rows([f"--out_dir={out}", "--split=val"])
    assert next(x for x in rows if x["task"] == "position")["loss"] != logged["position"]
    # recall past the trained length, in the dataset's tokens: a cell a length and depth
    long = ["--tasks=[needle,mqar_long]", "--depths=[0,1]", "--examples=8"]
    rows = eval_rows([f"--out_dir={out}", *long, "--lengths=[31]"])
    assert [(x["task"], x["length"], x.get("depth")) for x in rows] == [
        ("needle", 31, 0),
        ("needle", 31, 1),
        ("mqar_long", 31, None),
    ]
    assert all(x["n"] == 8 and x["low"] <= x["rate"] <= x["high"] for x in rows)
    # past its block_size a model of learned positions has none: one line
    r = cli(["eval.py", f"--out_dir={out}", "--device=cpu", "--progress=False", *long])
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "has none past them" in r.stderr, r.stderr


def test_a_zeroed_mixer_scores_as_the_model_whose_mixer_projects_to_zero(
    pycode_small: Path, tmp_path: Path
) -> None:
    """--zero_mixers=[0] gives the numbers of the same run with layer 0's attention output
    projection set to zero (the oracle, built by hand in its checkpoint), and not the whole
    model's; a layer the model lacks, or one named twice, is one line."""
    out = tmp_path / "run"
    flags = ["--max_iters=4", "--eval_interval=4", "--always_save_checkpoint=True"]
    run(["train.py", f"--dataset={pycode_small}", f"--out_dir={out}", *TINY_TRAIN, *flags])
    oracle = tmp_path / "oracle"
    shutil.copytree(out, oracle)
    ckpt = load_checkpoint(oracle / "ckpt.pt")
    for name, weights in ckpt["model"].items():
        if name.startswith("transformer.h.0.attn.c_proj."):
            weights.zero_()
    torch.save(ckpt, oracle / "ckpt.pt")
    tasks = "--tasks=[position]"
    zeroed = eval_rows([f"--out_dir={out}", tasks, "--zero_mixers=[0]"])
    assert all(row.pop("zero_mixers") == [0] for row in zeroed)
    assert zeroed == eval_rows([f"--out_dir={oracle}", tasks])
    whole = eval_rows([f"--out_dir={out}", tasks])
    assert whole[0]["task"] == "position" and whole[0]["loss"] != zeroed[0]["loss"]
    for bad, says in (("[2]", "the model has 2 layers (0 to 1), no layer 2"), ("[1,1]", "twice")):
        r = cli(["eval.py", f"--out_dir={out}", "--device=cpu", f"--zero_mixers={bad}"])
        assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
        assert says in r.stderr, r.stderr


def test_eval_py_refuses_a_dataset_it_cannot_read_before_any_work(
    pycode_small: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dataset of the run's vocabulary size but other characters (its ids other tokens to the
    model), and mqar beside induction on a dataset that is not MQAR: one line each, and no task
    starts (induction runs first)."""
    out = tmp_path / "run"
    run(
        [
            "train.py",
            f"--dataset={pycode_small}",
            f"--out_dir={out}",
            *TINY_TRAIN,
            "--max_iters=2",
            "--eval_interval=2",
        ]
    )
    shuffled = tmp_path / "shuffled"
    shutil.copytree(pycode_small, shuffled)
    meta = json.loads((shuffled / "meta.json").read_text())
    (shuffled / "meta.json").write_text(json.dumps(meta | {"chars": meta["chars"][::-1]}))
    monkeypatch.setattr(recall, "induction", lambda *a, **k: pytest.fail("a task ran"))
    monkeypatch.setattr(recall, "loss_by_position", lambda *a, **k: pytest.fail("a task ran"))
    wrong_tokens = (
        f"error: the checkpoint was trained on other tokens than dataset {shuffled}'s "
        f"(its tokenizer char, vocab_size {meta['vocab_size']}): evaluate the run in {out} "
        f"on a dataset made with its tokenizer, e.g. its own {pycode_small} (leave "
        f"--dataset out)"
    )
    # a dataset prepared before test splits: --split=test cannot read it
    old = tmp_path / "old"
    shutil.copytree(pycode_small, old)
    (old / "test.bin").unlink()
    (old / "meta.json").write_text(
        json.dumps({k: v for k, v in meta.items() if k != "test_tokens"})
    )
    for flags, message in [
        ([f"--dataset={shuffled}"], wrong_tokens),
        (["--tasks=[induction,position,mqar]"], "the mqar task reads an MQAR"),
        ([f"--dataset={old}", "--split=test"], f"split=test: {old} has no test split"),
        # a key that no task of the command reads
        (["--tasks=[position]", "--distances=[8]"], "distances=[8] is read by induction, and "),
        (["--tasks=[induction]", "--split=val"], "split='val' is read by position and mqar"),
        (["--tasks=[position]", "--examples=8"], "examples=8 is read by induction"),
    ]:
        r = cli(["eval.py", f"--out_dir={out}", "--device=cpu", "--progress=False", *flags])
        assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
        assert message in r.stderr, r.stderr


def test_final_evals_past_block_size_need_positions_that_go_on() -> None:
    """needle and mqar_long read past block_size: refused before training for learned positions."""
    with pytest.raises(ValueError, match="needle, mqar_long read past block_size, where learned"):
        TrainConfig(final_evals=["needle", "mqar_long"])
    assert TrainConfig(final_evals=["needle"], pos_encoding="rope").final_evals == ["needle"]


def test_a_task_that_needs_an_mqar_dataset_names_itself(pycode_small: Path, tmp_path: Path) -> None:
    """needle (or mqar_long) on a run trained on text, not MQAR: the line names the task asked
    for, the dataset it would read (the run's own) and why that is not one."""
    meta = json.loads((pycode_small / "meta.json").read_text())
    config = {"dataset": str(pycode_small), "seed": 1337}
    model = tiny_model(vocab_size=meta["vocab_size"], pos_encoding="rope")
    save_checkpoint(tmp_path / "ckpt.pt", model, iter_num=0, data_meta=meta, config=config)
    for tasks, named in [
        ("needle", "the needle task reads an MQAR dataset"),
        ("needle,mqar_long", "the needle and mqar_long tasks read an MQAR dataset"),
    ]:
        r = cli(["eval.py", f"--out_dir={tmp_path}", "--device=cpu", f"--tasks=[{tasks}]"])
        assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
        assert named in r.stderr and "mqar task" not in r.stderr, r.stderr
        assert f"{pycode_small} is not one (its meta.json records no example_tokens" in r.stderr
        assert f"leave {tasks.replace(',', ' and ')} out of the tasks" in r.stderr, r.stderr


def test_an_early_stop_on_text_is_one_line_before_any_work(
    pycode_small: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    flags = [f"--dataset={pycode_small}", "--device=cpu", f"--out_dir={out}"]
    r = cli(["train.py", *flags, "--stop_at_accuracy=0.99"])
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    reads = "stop_at_accuracy=0.99 reads the val accuracy on the answers of an MQAR dataset"
    assert reads in r.stderr, r.stderr
    assert not out.exists()


def test_an_early_stop_reads_the_pair_count_recalled_worst() -> None:
    """0.995 on the whole of a mix whose 32 pairs score 0.98 has not reached 0.99: stopped there,
    that count would be reported unsolved for the stop's sake."""
    mix = {
        "accuracy": 0.995,
        "by_pairs": [{"pairs": 4, "accuracy": 1.0}, {"pairs": 32, "accuracy": 0.98}],
    }
    assert recall.weakest(mix) == 0.98
    assert recall.weakest({"accuracy": 0.995}) == 0.995
