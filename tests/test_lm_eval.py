"""eval.py --lm_eval: lm-evaluation-harness on a run, offline, on the project's own tasks; its
scores held against the project's scorer, and against models whose answer is known by construction;
the harness's tasks out of reach said in one line before any work; the comparison's task columns."""

import json
import math
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from conftest import TINY_TRAIN, cli, read_log, run, tiny_model
from model import GPT, GPTConfig
from smallgpt import choice_task, harness, report
from smallgpt.checkpoint import load_run, parse_source, save_checkpoint
from smallgpt.data import load_meta
from smallgpt.tokenizer import load_tokenizer

ITEMS = 40  # an even count: the true line first in exactly half


@pytest.fixture(scope="module")
def lines_run(pycode_small: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny run trained to tell a real line from a corrupted one most of the time (block_size 64:
    most items are cut from the left, as the harness cuts them)."""
    out = tmp_path_factory.mktemp("lines_run") / "run"
    run(
        [
            "train.py",
            f"--dataset={pycode_small}",
            f"--out_dir={out}",
            *TINY_TRAIN,
            "--max_iters=40",
            "--eval_interval=40",
            "--block_size=64",
            "--always_save_checkpoint=True",
        ]
    )
    return out


def lm_eval_rows(args: list[str], tasks: str = "lines") -> dict[str, dict]:
    """eval.py's lm_eval lines by task name, for args and --lm_eval=[tasks] (which must succeed)."""
    r = cli(["eval.py", "--device=cpu", "--progress=False", f"--lm_eval=[{tasks}]", *args])
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["name"] for row in rows] == tasks.split(",")
    return {row["name"]: row for row in rows}


def test_the_harness_scores_the_projects_tasks_as_the_project_scorer_does_pair_for_pair(
    pycode_small: Path, lines_run: Path, tmp_path: Path
) -> None:
    """The harness on the run exported (its YAML, its hf model, its truncation) gives each choice of
    lines and next_line the log-likelihood that this project's scorer gives it from the items alone,
    and the same accuracy; eval.py leaves the run's folder as it was, but for the record of its
    scores."""
    model = load_run(parse_source("resume"), lines_run).model
    meta = load_meta(pycode_small)
    tok = load_tokenizer(meta)
    prefix = choice_task.prefix_token(tok)
    items = {}
    ours = {}
    for task in choice_task.TASKS:
        items[task] = choice_task.items_from_dataset(pycode_small, meta, tok, ITEMS, 3, 64, task)
        assert len(items[task]) == ITEMS
        assert [i["label"] for i in items[task]] == [0, 1] * (ITEMS // 2)
        ours[task] = choice_task.choice_scores(model, tok.encode, items[task], 8, prefix)
        choice_task.write_task(tmp_path, items[task], task)
    # most items are longer than the model's context, so both cut them
    longest = max(
        sum(map(len, choice_task.split_pair(tok.encode, i["context"], i["choices"][0])))
        for i in items["lines"]
    )
    assert longest > 65
    tasks = harness.resolve(list(choice_task.TASKS), tmp_path)
    with harness.model_folder(model, meta, None) as folder:
        results = harness.evaluate(folder, tasks, "cpu", "float32", 8, None, 64, prefix, False)
    for task in choice_task.TASKS:
        name = choice_task.HARNESS_NAMES[task]
        samples = sorted(results["samples"][name], key=lambda s: s["doc_id"])
        theirs = [[r[0] for r in s["filtered_resps"]] for s in samples]
        assert len(theirs) == ITEMS
        for mine, harnessed in zip(ours[task], theirs, strict=True):
            assert mine == pytest.approx(harnessed, abs=1e-4)
        # the two choices differ by more than the scorers do: the test can tell them apart
        assert min(abs(a - b) for a, b in ours[task]) > 1e-2
        correct, n = choice_task.accuracy(ours[task], [i["label"] for i in items[task]])
        assert results["results"][name]["acc,none"] == correct / n
    # trained: better than chance where a corrupted line is the wrong choice
    assert results["results"][choice_task.HARNESS_NAMES["lines"]]["acc,none"] > 0.6

    # eval.py: the same through the command, its check in its line, and the run's folder as it was
    before = {p.name: p.read_bytes() for p in lines_run.iterdir()}
    row = lm_eval_rows([f"--out_dir={lines_run}", f"--examples={ITEMS}"])["lines"]
    assert row["n"] == ITEMS and row["check_items"] == ITEMS and row["check_requests"] == 2 * ITEMS
    assert row["check_same_choice"] == ITEMS and row["check_max_abs_diff"] < 1e-4
    after = {p.name: p.read_bytes() for p in lines_run.iterdir()}
    assert after.keys() == before.keys()
    assert all(after[name] == data for name, data in before.items() if name != "log.jsonl")
    added = after["log.jsonl"][len(before["log.jsonl"]) :].decode().splitlines()
    record = json.loads(added[0])
    assert len(added) == 1 and record["event"] == "benchmarks" and record["iter"] == 40
    assert record["lm_eval"]["lines"]["acc"] == row["acc"]
    assert not list(Path(tempfile.gettempdir()).glob("smallgpt-lm-eval-*"))


def bigram_model(vocab: int, seen: torch.Tensor, gain: float = 150.0) -> GPT:
    """A GPT that is a bigram model by construction: token a's next-token logits are gain times
    the row seen[a] (1 where a -> b was seen) made zero-mean and unit-variance, so a seen successor
    is at least 2 * gain nats likelier than an unseen one. Attention adds nothing (its projection is
    zero); the MLP looks the current token up (one hidden unit per token) and writes that row."""
    config = GPTConfig(
        block_size=64, vocab_size=vocab, n_layer=1, n_head=1, n_embd=vocab, bias=True, dropout=0.0
    )
    model = GPT(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.transformer.wte.weight.copy_(torch.eye(vocab))  # tied: the logits are ln_f's output
        block = model.transformer.h[0]
        for norm in (block.ln_1, block.ln_2, model.transformer.ln_f):
            norm.weight.fill_(1.0)
        model.transformer.ln_f.weight.fill_(gain)
        # ln_2 of a one-hot row: 1/sigma at its token, 0 elsewhere, after the shift of -1/(V sigma)
        sigma = math.sqrt((1 / vocab) * (1 - 1 / vocab) + 1e-5)
        active = (1 - 1 / vocab) / sigma
        inactive = -(1 / vocab) / sigma
        k = 60.0 / (active - inactive)
        block.mlp.c_fc.weight[:vocab].copy_(k * torch.eye(vocab))
        block.mlp.c_fc.bias[:vocab].fill_(-k * (active + inactive) / 2)  # +-30 before the GELU
        rows = seen.double()
        rows[rows.sum(1) == 0] = 1 - torch.eye(vocab, dtype=torch.double)[rows.sum(1) == 0]
        rows = rows - rows.mean(1, keepdim=True)
        block.mlp.c_proj.weight[:, :vocab].copy_((1000.0 * rows).T.float() / 30.0)
    return model


def transitions(ids: list[int]) -> list[tuple[int, int]]:
    return list(zip(ids[:-1], ids[1:], strict=True))


def test_a_true_line_preferring_model_scores_1_and_a_constant_one_exactly_half(
    pycode_small: Path, tmp_path: Path
) -> None:
    """Through eval.py and the harness: a bigram model of the true choices' transitions scores
    100% (every corrupted choice makes a transition no true one makes, checked here), and the
    same model with its final norm's gain zero (all logits 0: every pair a tie) exactly 50%, on
    next_line too."""
    meta = load_meta(pycode_small)
    tok = load_tokenizer(meta)
    vocab = meta["vocab_size"]
    items = choice_task.items_from_dataset(pycode_small, meta, tok, ITEMS, 1337, 64, "lines")
    scored = []  # each item's (true, corrupted) transitions the scorer reads
    for item in items:
        pair = []
        for choice in item["choices"]:
            context, continuation = choice_task.split_pair(tok.encode, item["context"], choice)
            pair.append(transitions(context[-1:] + continuation))
        label = item["label"]
        scored.append((pair[label], pair[1 - label]))
    seen = torch.zeros(vocab, vocab)
    for true, _ in scored:
        for a, b in true:
            seen[a, b] = 1
    # the construction's premise: each corrupted choice makes an unseen transition from a token
    # that has seen ones
    for _, corrupted in scored:
        assert any(seen[a, b] == 0 and seen[a].sum() > 0 for a, b in corrupted)
    bigram = bigram_model(vocab, seen)
    constant = bigram_model(vocab, seen, gain=0.0)
    labels = [i["label"] for i in items]
    for name, model in (("bigram", bigram), ("constant", constant)):
        folder = tmp_path / name
        folder.mkdir()
        save_checkpoint(
            folder / "ckpt.pt",
            model,
            iter_num=0,
            data_meta=meta,
            config={"dataset": str(pycode_small), "seed": 1337},
        )
    args = [f"--examples={ITEMS}", "--batch_size=8"]
    row = lm_eval_rows([f"--out_dir={tmp_path / 'bigram'}", *args])["lines"]
    assert row["acc"] == 1.0 and row["n"] == ITEMS
    assert row["check_same_choice"] == ITEMS and row["check_max_abs_diff"] < 1e-3
    scores = choice_task.choice_scores(bigram, tok.encode, items, 8)
    assert choice_task.accuracy(scores, labels) == (ITEMS, ITEMS)
    # the constant model on both tasks: every pair a tie, the first choice taken, half right
    rows = lm_eval_rows([f"--out_dir={tmp_path / 'constant'}", *args], "lines,next_line")
    for task, row in rows.items():
        assert row["acc"] == 0.5 and row["n"] == ITEMS, task
        assert row["check_same_choice"] == ITEMS and row["check_max_abs_diff"] < 1e-3, task
    scores = choice_task.choice_scores(constant, tok.encode, items, 8)
    assert all(a == b for a, b in scores)  # ties: each choice as many tokens
    assert choice_task.accuracy(scores, labels) == (ITEMS // 2, ITEMS)


def test_the_harness_out_of_reach_or_not_installed_is_one_line_before_any_work(
    lines_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tasks whose data is on the hub, with the hub out of reach (online) or not in the cache
    (offline), or lm-eval missing, or a task name it does not know: one line each, and the run's
    folder untouched."""
    import datasets
    import huggingface_hub.constants

    before = (lines_run / "log.jsonl").read_bytes()
    args = ["eval.py", f"--out_dir={lines_run}", "--device=cpu", "--lm_eval=[hellaswag]"]
    # online, with the hub's address where nothing listens
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    for proxy in harness.PROXY_VARIABLES:
        monkeypatch.delenv(proxy, raising=False)
    r = cli(args)
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.splitlines()) == 1, r.stderr
    assert "hellaswag (Rowan/hellaswag) read their data from the Hugging Face hub" in r.stderr
    assert "http://127.0.0.1:9 cannot be reached" in r.stderr
    # offline, with an empty cache
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    r = cli(args)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "hellaswag reads Rowan/hellaswag from the Hugging Face hub, and offline" in r.stderr
    # a name the harness does not know
    r = cli([*args[:-1], "--lm_eval=[hellaswg]"])
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "'hellaswg' is not a task, group or tag" in r.stderr and "hellaswag" in r.stderr
    # lm-eval not installed
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    r = cli([*args[:-1], "--lm_eval=[lines]"])
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "pip install 'lm-eval>=0.4.9' accelerate" in r.stderr
    assert (lines_run / "log.jsonl").read_bytes() == before


def test_the_report_gives_each_task_its_mean_over_seeds_and_the_paired_difference_to_mha() -> None:
    """benchmark_columns against a hand computation: three seeds' accuracies, their mean and
    Student t half-width (t(0.975, 2) = 4.3027), and the seed-paired difference to MHA's (only the
    seeds both have); a task a run has not scored has no column."""

    def runs(values: dict[int, float | None]) -> list[dict]:
        return [
            {"seed": seed, "benchmarks": {} if v is None else {"lines": {None: {"acc": v}}}}
            for seed, v in values.items()
        ]

    mha = runs({1: 0.50, 2: 0.60, 3: 0.55})
    gqa = runs({1: 0.60, 2: 0.65, 3: 0.80})
    cols = report.benchmark_columns(gqa, mha, ["lines", "hellaswag"], None)
    assert report.benchmark_columns(gqa, mha, ["lines"], 100) == {}  # scored at no limit
    mean = (0.60 + 0.65 + 0.80) / 3
    sd = math.sqrt(((0.60 - mean) ** 2 + (0.65 - mean) ** 2 + (0.80 - mean) ** 2) / 2)
    assert cols["lines_acc"] == pytest.approx(mean)
    assert cols["lines_acc_ci95"] == pytest.approx(4.3027 * sd / math.sqrt(3), rel=1e-4)
    diffs = [0.10, 0.05, 0.25]
    diff_mean = sum(diffs) / 3
    diff_sd = math.sqrt(sum((d - diff_mean) ** 2 for d in diffs) / 2)
    assert cols["lines_acc_diff_vs_mha"] == pytest.approx(diff_mean)
    assert cols["lines_acc_diff_vs_mha_ci95"] == pytest.approx(
        4.3027 * diff_sd / math.sqrt(3), rel=1e-4
    )
    assert cols["lines_acc_diff_pairs"] == 3
    assert not any(k.startswith(("hellaswag", "lines_n")) for k in cols)
    # MHA itself: no difference; a run not scored: no column
    assert report.benchmark_columns(mha, None, ["lines"], None)["lines_acc_diff_vs_mha"] is None
    assert report.benchmark_columns(runs({1: 0.5, 2: None}), None, ["lines"], None) == {}


def test_a_run_whose_log_has_scores_reads_them_back_at_its_final_iteration(tmp_path: Path) -> None:
    """read_run's benchmarks: eval.py's records at the final iteration by task and limit, a later
    one's over an earlier one's; those of another iteration are not the final model's."""
    from smallgpt.runlog import append_record, read_run

    config = {"init_from": "scratch", "max_iters": 40}
    start = {"event": "config", "config": config, "model_config": {}, "start_iter": 0}
    (tmp_path / "log.jsonl").write_text(json.dumps(start))  # its last line not ended yet
    first = {"lines": {"acc": 0.25, "limit": None}}
    append_record(tmp_path, event="benchmarks", iter=40, lm_eval=first)
    other_iteration = {"arc_easy": {"acc": 0.3, "limit": None}}
    append_record(tmp_path, event="benchmarks", iter=30, lm_eval=other_iteration)
    limited = {"lines": {"acc": 0.5, "limit": 8}}
    append_record(tmp_path, event="benchmarks", iter=40, lm_eval=limited)
    again = {"lines": {"acc": 0.75, "limit": None}}
    append_record(tmp_path, event="benchmarks", iter=40, lm_eval=again)
    assert read_run(tmp_path)["benchmarks"] == {
        "lines": {None: again["lines"], 8: limited["lines"]}
    }
    assert [r["event"] for r in read_log(tmp_path)] == ["config", *["benchmarks"] * 4]


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--lm_eval_limit=5", "lm_eval_limit=5 is read by lm_eval's tasks, and lm_eval=[] names"),
        # a case of the class not listed: the scorer's check of the harness's scores
        ("--lm_eval_check=False", "lm_eval_check=False is read by lm_eval's tasks, and lm_eval"),
    ],
)
def test_a_harness_setting_without_lm_eval_is_one_line(
    flag: str, message: str, tmp_path: Path
) -> None:
    """A key that only the harness's tasks read, given without --lm_eval, would change nothing:
    one line naming it, before the run is read (the folder holds none)."""
    r = cli(["eval.py", f"--out_dir={tmp_path}", "--device=cpu", flag])
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"error: {message}") and "leave " in r.stderr, r.stderr


def test_a_run_whose_log_cannot_take_the_scores_is_refused_before_any_work(
    pycode_small: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """eval.py --lm_eval appends its scores to the run's log.jsonl: where that cannot be written,
    one line naming the folder, before the harness starts (not after every task is scored). A
    folder in the log's place stops root too; chmod stops anyone else."""
    meta = load_meta(pycode_small)
    out = tmp_path / "run"
    out.mkdir()
    config = {"dataset": str(pycode_small), "seed": 1337}
    model = tiny_model(vocab_size=meta["vocab_size"])
    save_checkpoint(out / "ckpt.pt", model, iter_num=0, data_meta=meta, config=config)
    monkeypatch.setattr(harness, "check_installed", lambda: pytest.fail("the harness started"))
    args = ["eval.py", f"--out_dir={out}", "--device=cpu", "--lm_eval=[lines]"]
    (out / "log.jsonl").mkdir()
    r = cli(args)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert f"appends its scores to {out / 'log.jsonl'}, which cannot be written" in r.stderr
    assert f"make {out} writable" in r.stderr, r.stderr
    if os.geteuid() != 0:  # root writes whatever the mode bits say
        (out / "log.jsonl").rmdir()
        (out / "log.jsonl").write_text("")
        (out / "log.jsonl").chmod(0o444)
        out.chmod(0o555)
        try:
            r = cli(args)
        finally:
            out.chmod(0o755)
        assert r.returncode == 2 and f"make {out} writable" in r.stderr, r.stderr
