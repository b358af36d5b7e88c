import csv
import dataclasses
import glob
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from configurator import parse_config
from conftest import NO_PROBE, ROOT, TINY_TRAIN, cli, read_log, run, tiny_model
from model import GPT, GPTConfig
from smallgpt import rate_bracket, sweep
from smallgpt.checkpoint import load_checkpoint, save_checkpoint
from smallgpt.configs import CompareConfig, TrainConfig
from smallgpt.convert import convert_kv_heads
from smallgpt.data import load_meta
from smallgpt.errors import UserError
from smallgpt.runlog import read_run
from smallgpt.sweep import matched_mlp_hidden
from smallgpt.variant import Variant

# TINY_TRAIN's model and run (its dtype float32, not auto: on a CPU with native bf16 the timing
# probe may pick either), with the sweep's budget and its decode measurements kept small
SWEEP = [
    *TINY_TRAIN,
    "--max_iters=30",
    "--eval_interval=10",
    "--decode_batch=2",
    "--decode_context=40",
    "--decode_steps=3",
    "--speed_repeats=2",
    NO_PROBE,  # no test here reads MFU
]
# A plan without a dataset times each shape's training step at GPT-2's padded vocabulary (50,304
# logits a token: seconds a shape on a CPU), and with the default one (data/pycode_char, there once
# the quick start ran) at its size: the plans below name a small dataset of their own
T_975_1 = 12.706204736  # Student t(0.975) with 1 degree of freedom, from a printed table
# The tests that read the one sweep below run in one pytest-xdist worker, which builds it once
SHARED_SWEEP = pytest.mark.xdist_group("compare_seeds_sweep")


@dataclasses.dataclass
class Sweep:
    out: Path  # the comparison's folder, read-only: a test that changes it changes a copy
    args: list[str]  # its compare.py command line, without the report's kv_seq_len and kv_batch
    stdout: str  # what the sweep printed


def sweep_args(dataset: Path, out: Path) -> list[str]:
    return [
        "compare.py",
        f"--dataset={dataset}",
        f"--out_dir={out}",
        *SWEEP,
        "--kv_heads=[4,1]",
        "--seeds=2",
        "--match=params",
        "--convert=True",
        "--convert_methods=[first]",
        "--uptrain_fractions=[0,0.5]",
    ]


@pytest.fixture(scope="module")
def seeds_sweep(pycode_small: Path, tmp_path_factory: pytest.TempPathFactory) -> Sweep:
    """One sweep, trained and reported once (8 train.py processes), for the tests that read it:
    MHA and MQA matched to its parameters, and MHA converted to MQA (method first) at uptraining
    fractions 0 and 0.5, each at 2 seeds."""
    out = tmp_path_factory.mktemp("seeds_sweep") / "cmp"
    args = sweep_args(dataset=pycode_small, out=out)
    r = run([*args, "--kv_seq_len=100", "--kv_batch=3"], env={"WANDB_MODE": "disabled"})
    return Sweep(out, args, r.stdout)


@pytest.mark.parametrize("pos_encoding", ["learned", "rope"])
@pytest.mark.parametrize("G", [4, 2, 1])
def test_converting_heads_already_equal_within_groups_keeps_the_logits(
    G: int, pos_encoding: str
) -> None:
    m = tiny_model(4, pos_encoding, n_head=8, n_embd=64)  # 4 K/V heads: pool them into G groups
    with torch.no_grad():
        for block in m.transformer.h:  # make the K/V heads of each future group identical
            for lin in (block.attn.c_k, block.attn.c_v):
                w = lin.weight.view(G, 4 // G, 8, 64)
                w.copy_(w[:, :1].expand_as(w))
                b = lin.bias.view(G, 4 // G, 8)
                b.copy_(b[:, :1].expand_as(b))
    converted = convert_kv_heads(m, G).eval()
    assert converted.config.n_kv_head == G
    idx = torch.randint(0, 61, (2, 24))
    # The weights are the same numbers; the logits differ at most by float rounding of SDPA over G
    # vs 4 heads.
    torch.testing.assert_close(
        converted(idx, targets=idx)[0], m(idx, targets=idx)[0], rtol=0, atol=1e-6
    )


def test_conversion_is_the_mean_of_each_groups_heads() -> None:
    m = tiny_model(None)  # MHA, 4 heads of 8 dims, 32 wide
    c = convert_kv_heads(m, 2)
    for old, new in zip(m.transformer.h, c.transformer.h, strict=True):
        for name in ("c_k", "c_v"):
            w, b = getattr(old.attn, name).weight, getattr(old.attn, name).bias
            by_hand = torch.cat([(w[0:8] + w[8:16]) / 2, (w[16:24] + w[24:32]) / 2])
            torch.testing.assert_close(getattr(new.attn, name).weight, by_hand, rtol=0, atol=1e-7)
            torch.testing.assert_close(
                getattr(new.attn, name).bias,
                torch.cat([(b[0:8] + b[8:16]) / 2, (b[16:24] + b[24:32]) / 2]),
            )
        assert torch.equal(new.attn.c_q.weight, old.attn.c_q.weight)
        assert torch.equal(new.attn.c_proj.weight, old.attn.c_proj.weight)
        assert torch.equal(new.mlp.c_fc.weight, old.mlp.c_fc.weight)


def test_converted_checkpoint_trains_samples_and_resumes(
    pycode_small: Path, tmp_path: Path
) -> None:
    src, dst = tmp_path / "mha", tmp_path / "mqa"
    run(
        [
            "train.py",
            f"--dataset={pycode_small}",
            f"--out_dir={src}",
            *TINY_TRAIN,
            NO_PROBE,
            "--max_iters=20",
            "--eval_interval=20",
        ]
    )
    run(
        [
            "train.py",
            f"--dataset={pycode_small}",
            f"--out_dir={dst}",
            *TINY_TRAIN,
            NO_PROBE,
            f"--init_from=convert:{src}",
            "--n_kv_head=1",
            "--max_iters=10",
            "--eval_interval=10",
        ]
    )
    ckpt = load_checkpoint(dst / "ckpt.pt")
    assert ckpt["model_config"]["n_kv_head"] == 1 and ckpt["iter_num"] == 10
    assert ckpt["model"]["transformer.h.0.attn.c_k.weight"].shape == (8, 32)
    first = [r for r in read_log(dst) if r["event"] == "eval"][0]
    src_evals = [
        r["val_loss"] for r in read_log(src) if r["event"] == "eval"
    ]  # at iterations 0 and 20
    # near the trained model
    assert first["iter"] == 0 and first["val_loss"] < (src_evals[0] + src_evals[-1]) / 2
    out = run(
        ["sample.py", f"--out_dir={dst}", "--start=def ", "--max_new_tokens=20", "--device=cpu"]
    )
    assert out.stdout.startswith("def ") and "MQA (n_head=4, n_kv_head=1)" in out.stderr
    run(
        [
            "train.py",
            f"--dataset={pycode_small}",
            f"--out_dir={dst}",
            *TINY_TRAIN,
            NO_PROBE,
            "--init_from=resume",
            "--n_kv_head=1",
            "--max_iters=20",
            "--eval_interval=10",
            "--always_save_checkpoint=True",
        ]
    )
    assert load_checkpoint(dst / "ckpt.pt")["iter_num"] == 20


def test_converting_to_a_group_count_that_does_not_divide_n_head_is_one_line(
    pycode_small: Path, tmp_path: Path
) -> None:
    r = cli(
        [
            "train.py",
            f"--dataset={pycode_small}",
            f"--out_dir={tmp_path}",
            *TINY_TRAIN,
            f"--init_from=convert:{tmp_path / 'x'}",
            "--n_kv_head=3",
        ]
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1
    assert "n_head=4 must be divisible by n_kv_head=3" in r.stderr


def test_first_conversion_keeps_each_groups_first_head_and_random_is_a_fresh_models() -> None:
    m = tiny_model(None)  # MHA, 4 heads of 8 dims, 32 wide
    first = convert_kv_heads(m, 2, "first")
    fresh = GPT(dataclasses.replace(m.config, n_kv_head=2))
    fresh.init_weights(seed=7)
    rand = convert_kv_heads(m, 2, "random", seed=7)
    for old, f, r, new in zip(
        m.transformer.h, first.transformer.h, rand.transformer.h, fresh.transformer.h, strict=True
    ):
        for name in ("c_k", "c_v"):
            w, b = getattr(old.attn, name).weight, getattr(old.attn, name).bias
            assert torch.equal(
                getattr(f.attn, name).weight, torch.cat([w[0:8], w[16:24]])
            )  # heads 0 and 2
            assert torch.equal(getattr(f.attn, name).bias, torch.cat([b[0:8], b[16:24]]))
            assert torch.equal(getattr(r.attn, name).weight, getattr(new.attn, name).weight)
            assert not torch.equal(getattr(r.attn, name).weight[:8], w[:8])
        for conv in (f, r):
            assert torch.equal(conv.attn.c_q.weight, old.attn.c_q.weight)
            assert torch.equal(conv.mlp.c_fc.weight, old.mlp.c_fc.weight)
    assert not torch.equal(
        convert_kv_heads(m, 2, "random", seed=8).transformer.h[0].attn.c_k.weight,
        rand.transformer.h[0].attn.c_k.weight,
    )


def test_a_seed_gives_every_shape_the_same_weights_where_shapes_allow() -> None:
    config = GPTConfig(block_size=16, vocab_size=50, n_layer=2, n_head=4, n_embd=32)
    models = {}
    for key, change in {"mha": {}, "mqa": {"n_kv_head": 1}, "wide": {"mlp_hidden": 200}}.items():
        models[key] = GPT(dataclasses.replace(config, **change))
        models[key].init_weights(seed=3)
    mha, mqa, wide = (dict(models[k].named_parameters()) for k in ("mha", "mqa", "wide"))
    for name, p in mha.items():
        if ".c_k." in name or ".c_v." in name:
            assert torch.equal(mqa[name], p[:8])  # the one K/V head: the first rows of MHA's
        else:
            assert torch.equal(mqa[name], p)
        if name.endswith("mlp.c_fc.weight"):
            assert torch.equal(
                wide[name][:128], p
            )  # the wider MLP starts with the narrower one's rows
    other = GPT(config)
    other.init_weights(seed=4)
    assert not torch.equal(
        other.transformer.h[0].attn.c_q.weight, mha["transformer.h.0.attn.c_q.weight"]
    )


@pytest.mark.parametrize("n_kv_head", [1, 2, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_params_match_widens_the_mlp_to_mhas_count_within_one_percent(
    n_kv_head: int, bias: bool
) -> None:
    mha = GPTConfig(block_size=64, vocab_size=95, n_layer=3, n_head=4, n_embd=64, bias=bias)
    config = dataclasses.replace(mha, n_kv_head=n_kv_head)
    hidden = matched_mlp_hidden(mha, config)
    count = lambda c: sum(p.numel() for p in GPT(c).parameters())  # noqa: E731
    target, got = count(mha), count(dataclasses.replace(config, mlp_hidden=hidden))
    assert abs(got - target) <= 0.01 * target
    # by hand: each layer's K/V projections lose 2 * D * (H - G) * head_dim weights (+ biases); each
    # unit of MLP width costs 2 * D weights (+ 1 bias); the nearest width
    lost = 2 * (64 * (4 - n_kv_head) * 16 + bias * (4 - n_kv_head) * 16)
    assert hidden == 256 + round(lost / (2 * 64 + bias))
    if n_kv_head == 4:
        assert hidden == 256 and got == target  # MHA keeps its own width exactly


def test_student_t_interval_and_paired_difference_match_hand_computation() -> None:
    from smallgpt import stats

    est = stats.mean_interval([1.50, 1.52, 1.55])
    mean = (1.50 + 1.52 + 1.55) / 3
    sd = math.sqrt(((1.50 - mean) ** 2 + (1.52 - mean) ** 2 + (1.55 - mean) ** 2) / 2)
    assert est.n == 3 and est.mean == pytest.approx(mean, abs=1e-12)
    assert est.half_width == pytest.approx(
        4.302653 * sd / math.sqrt(3), rel=1e-6
    )  # t(0.975, 2) from a table
    # paired on seeds 1, 2, 3
    a, b = ({1: 1.60, 2: 1.58, 3: 1.63, 9: 2.0}, {1: 1.50, 2: 1.52, 3: 1.55, 7: 1.0})
    d = stats.paired_difference(a, b)
    diffs = [0.10, 0.06, 0.08]
    sd = math.sqrt(sum((x - 0.08) ** 2 for x in diffs) / 2)
    assert (
        d.n == 3
        and d.mean == pytest.approx(0.08)
        and d.half_width == pytest.approx(4.302653 * sd / math.sqrt(3), rel=1e-6)
    )
    # pairing removes the seeds' spread
    assert d.half_width < stats.mean_interval([1.60, 1.58, 1.63]).half_width
    assert stats.verdict("mqa", "MHA", d) == (
        "mqa is 0.0800 ± 0.0497 nats worse than MHA (3 seeds, 95% interval "
        "of the seed-paired difference)."
    )
    assert "no difference from MHA detected at 2 seeds" in stats.verdict(
        "gqa", "MHA", stats.mean_interval([0.1, -0.1])
    )
    assert "no interval" in stats.verdict("gqa", "MHA", stats.mean_interval([0.1]))
    assert stats.t_quantile(4) == pytest.approx(2.776445, rel=1e-6)


def test_speed_ratio_is_stated_only_when_the_paired_repeats_separate_it() -> None:
    from smallgpt import stats

    same = stats.speed_ratio(
        [10.0, 20.0, 30.0], [11.0, 22.0, 33.0]
    )  # ranges overlap, every round 1/1.1: drift
    assert (
        same.separated
        and same.ratio == pytest.approx(1 / 1.1)
        and same.low == pytest.approx(1 / 1.1)
    )
    assert stats.speed_verdict(same, "MHA") == (
        "Its cached decode ran at 0.91x MHA's speed (95% interval "
        "0.91-0.91x over 3 paired repeats)."
    )
    # the loaded machine: 26 (24-837) against 67 (24-149) tok/s
    noisy = stats.speed_ratio([26.0, 24.0, 837.0], [67.0, 149.0, 24.0])
    logs = [math.log(26 / 67), math.log(24 / 149), math.log(837 / 24)]
    mean = sum(logs) / 3
    # t(0.975, 2) from a table
    half = 4.302653 * math.sqrt(sum((x - mean) ** 2 for x in logs) / 2) / math.sqrt(3)
    assert noisy.n == 3 and not noisy.separated
    assert (noisy.ratio, noisy.low, noisy.high) == pytest.approx(
        (math.exp(mean), math.exp(mean - half), math.exp(mean + half)), rel=1e-6
    )
    assert stats.speed_verdict(noisy, "MHA") == (
        f"Its cached decode speed is within noise of MHA's (the ratio's 95% "
        f"interval {math.exp(mean - half):.2f}-{math.exp(mean + half):.2f}x "
        f"over 3 paired repeats includes 1)."
    )
    apart = stats.speed_ratio(
        [50.0, 52.0], [100.0, 101.0]
    )  # halved in both rounds: ln(0.5), ln(52/101)
    # t(0.975, 1) * s / sqrt(2), s = |a - b| / sqrt(2)
    half = 12.706205 * abs(math.log(0.5) - math.log(52 / 101)) / 2
    assert apart.low == pytest.approx(math.sqrt(0.5 * 52 / 101) * math.exp(-half), rel=1e-6)
    assert apart.separated and "ran at 0.51x MHA's speed" in stats.speed_verdict(apart, "MHA")
    once = stats.speed_ratio([50.0], [100.0, 90.0])  # one pair: no interval
    assert once.n == 1 and once.low is None and not once.separated
    assert "in 1 repeat, with no interval: measure with --speed_repeats=3" in stats.speed_verdict(
        once, "MHA"
    )
    assert stats.speed_ratio([], [1.0]) is None


def final_val_loss(run_dir: Path, split: str = "val") -> float:
    return [r for r in read_log(run_dir) if r["event"] == "eval"][-1][f"{split}_loss"]


@pytest.mark.slow  # 8 train.py processes (seeds_sweep's), then 2 processes
@SHARED_SWEEP
def test_sweep_over_seeds_with_params_match_and_conversions(
    pycode_small: Path, seeds_sweep: Sweep, tmp_path: Path
) -> None:
    """The sweep as made (seeds_sweep), read; then, on a copy of it, the report alone with wandb,
    the sweep run again, a lost run made again, and killed runs left out of the report."""
    out, args = seeds_sweep.out, seeds_sweep.args
    assert "[8/8] mha-to-mqa-first-u0.5-s1338 done in" in seeds_sweep.stdout
    assert "left" in seeds_sweep.stdout
    rows = {row["variant"]: row for row in csv.DictReader(open(out / "report.csv"))}
    assert list(rows) == ["mha", "mqa-params", "mha-to-mqa-first-u0", "mha-to-mqa-first-u0.5"]
    D, H, L, V, T = 32, 4, 2, int(read_log(out / "mha-s1337")[0]["model_config"]["vocab_size"]), 32
    for row in rows.values():
        G, hidden = int(row["n_kv_head"]), int(row["mlp_hidden"])
        attn = 2 * D * D + 2 * D * D * G // H  # bias=False, the TrainConfig default
        assert int(row["attention_params"]) == L * attn
        # learned positions
        assert int(row["params"]) == L * (attn + 2 * D * hidden + 2 * D) + D + V * D + T * D
        # --decode_context=40
        assert int(row["kv_bytes@40_bfloat16"]) == 2 * L * G * (D // H) * 2 * 40
        assert int(row["kv_bytes@100x3"]) == 2 * L * 3 * G * 100 * (D // H) * 2
        assert int(row["decode_repeats"]) == 2 and 0 < float(row["decode_tok_s_min"]) <= float(
            row["decode_tok_s"]
        )
        assert int(row["seeds"]) == 2
    assert int(rows["mha"]["mlp_hidden"]) == int(rows["mha-to-mqa-first-u0"]["mlp_hidden"]) == 4 * D
    assert abs(int(rows["mqa-params"]["params"]) - int(rows["mha"]["params"])) <= 0.01 * int(
        rows["mha"]["params"]
    )
    # the statistics, by hand from each run's own log: mean, t interval with 1 degree of freedom,
    # paired difference
    finals = {name: [final_val_loss(out / f"{name}-s{s}") for s in (1337, 1338)] for name in rows}
    tests = {
        name: [final_val_loss(out / f"{name}-s{s}", "test") for s in (1337, 1338)] for name in rows
    }
    for name in rows:
        for split, (a, b) in (("val", finals[name]), ("test", tests[name])):
            assert float(rows[name][f"{split}_loss"]) == pytest.approx((a + b) / 2, rel=1e-12)
            assert float(rows[name][f"{split}_loss_ci95"]) == pytest.approx(
                T_975_1 * abs(a - b) / 2, rel=1e-6
            )
        assert rows[name]["split"] == "test"  # pycode_small has a test split: the figures are its
    d = [tests["mqa-params"][i] - tests["mha"][i] for i in (0, 1)]
    assert float(rows["mqa-params"]["diff_vs_mha"]) == pytest.approx(sum(d) / 2, rel=1e-9)
    assert float(rows["mqa-params"]["diff_vs_mha_ci95"]) == pytest.approx(
        T_975_1 * abs(d[0] - d[1]) / 2, rel=1e-6
    )
    # fraction 0: evaluated right after conversion, nothing trained or saved; the same model the 0.5
    # run starts from
    u0 = read_log(out / "mha-to-mqa-first-u0-s1337")
    assert [e["iter"] for e in u0 if e["event"] == "eval"] == [0] and not [
        e for e in u0 if e["event"] == "train"
    ]
    assert not (out / "mha-to-mqa-first-u0-s1337" / "ckpt.pt").exists()
    u5 = [e for e in read_log(out / "mha-to-mqa-first-u0.5-s1337") if e["event"] == "eval"]
    assert [e["iter"] for e in u5] == [0, 15] and u5[0]["val_loss"] == finals[
        "mha-to-mqa-first-u0"
    ][0]
    # the uptrained model, not the first eval
    assert u5[-1]["val_loss"] == finals["mha-to-mqa-first-u0.5"][0]
    config = read_log(out / "mha-to-mqa-first-u0.5-s1338")[0]["config"]
    assert (
        config["convert_method"] == "first"
        and config["init_from"] == f"convert:{out / 'mha-s1338'}"
    )
    assert (config["max_iters"], config["lr_decay_iters"], config["warmup_iters"]) == (
        15,
        15,
        1,
    )  # its own schedule
    assert config["wandb_group"] == "cmp" and {
        "mha-to-mqa-first-u0.5",
        "seed=1338",
        "convert=first",
        "uptrain=0.5",
    } <= set(config["wandb_tags"])
    md = (out / "report.md").read_text()
    assert (
        "## 2x32" in md
        and "by method" in md
        and "by uptraining fraction" in md
        and "- mqa-params" in md
    )
    assert (out / "report.png").read_bytes()[:4] == b"\x89PNG"
    # what follows changes the sweep: a copy of it (named as it is, cmp: the runs' wandb group)
    out = tmp_path / "cmp"
    shutil.copytree(seeds_sweep.out, out)
    args = sweep_args(dataset=pycode_small, out=out)
    # the report alone reads the logs and the stored speeds: the same table, nothing measured again;
    # with wandb (offline here), its rows also go to one wandb Table in a run of the sweep's group
    before = (out / "report.csv").read_text()
    r = run(
        [*args, "--kv_seq_len=100", "--kv_batch=3", "--mode=report", "--wandb_log=True"],
        env={"WANDB_MODE": "offline"},
        fresh=True,
    )
    assert (out / "report.csv").read_text() == before and "decode speed of" not in r.stdout
    tables = glob.glob(
        str(
            out / "wandb" / "offline-run-*" / "files" / "media" / "table" / "comparison*.table.json"
        )
    )
    assert len(tables) == 1
    table = json.loads(Path(tables[0]).read_text())
    assert [row[table["columns"].index("variant")] for row in table["data"]] == list(rows)
    assert "val_loss_ci95" in table["columns"] and "diff_vs_mha" in table["columns"]
    # run again: nothing trains; a run lost (folder deleted) is the only one made again
    logs = {
        d.name: (d / "log.jsonl").read_text() for d in out.iterdir() if (d / "log.jsonl").is_file()
    }
    r = run([*args, "--mode=plan"])
    assert "8 runs, 0 to run" in r.stdout
    r = run([*args, "--mode=train"], env={"WANDB_MODE": "disabled"})
    assert "8 of 8 runs already finished" in r.stdout and "$ python train.py" not in r.stdout
    for d in out.glob("mqa-params-s1338"):
        for f in d.iterdir():
            f.unlink()
        d.rmdir()
    r = run([*args, "--mode=train"], env={"WANDB_MODE": "disabled"})
    assert (
        r.stdout.count("$ python train.py") == 1
        and f"--out_dir={out / 'mqa-params-s1338'}" in r.stdout
    )
    assert all(
        (out / name / "log.jsonl").read_text() == log
        for name, log in logs.items()
        if name != "mqa-params-s1338"
    )
    # killed runs (a last line cut short, after the final evaluation; no evaluation yet) are left
    # out of the report with a line
    with open(out / "mha-s1338" / "log.jsonl", "a") as f:
        f.write('{"event": "eval", "iter": 4')
    mqa_log = out / "mqa-params-s1338" / "log.jsonl"
    mqa_log.write_text(mqa_log.read_text().splitlines()[0] + "\n")
    # the same run in a folder this command does not name (an earlier sweep's): not read
    shutil.copytree(out / "mha-s1337", out / "mha")
    r = run([*args, "--mode=report"])
    assert (
        f"Left out of the report, unfinished: {out / 'mha-s1338'} (its log's last line is cut "
        f"short (killed while writing it)); {out / 'mqa-params-s1338'} (no evaluation logged yet)"
    ) in r.stderr
    assert f"Not read: mha under {out}, runs that this command does not name" in r.stderr
    again = {row["variant"]: row for row in csv.DictReader(open(out / "report.csv"))}
    assert again["mqa-params"]["seeds"] == "1" and again["mqa-params"]["val_loss_ci95"] == ""
    assert again["mha"]["seeds"] == "1"
    mqa_log.write_text("")
    r = cli([*args, "--mode=report"])
    assert (
        r.returncode == 2
        and r.stderr
        == f"error: {mqa_log} holds no run's config record: not a log written by train.py\n"
    )


@pytest.mark.slow  # 1 train.py process
@SHARED_SWEEP
def test_a_run_whose_final_record_was_torn_is_evaluated_again_by_the_sweep(
    pycode_small: Path, seeds_sweep: Sweep, tmp_path: Path
) -> None:
    """A kill while train.py wrote its final evaluation leaves the log's last line cut short and
    the checkpoint at max_iters: the sweep counts the run unfinished and evaluates that
    checkpoint again (resuming alone would find nothing to train), which gives the lost record
    back, the same number. The run: a copy of seeds_sweep's mha-s1337 (the model, seed and schedule
    that this sweep of MHA alone trains) in a sweep folder of its own."""
    out = tmp_path / "cmp"
    args = ["compare.py", f"--dataset={pycode_small}", f"--out_dir={out}", *SWEEP, "--kv_heads=[4]"]
    shutil.copytree(seeds_sweep.out / "mha-s1337", out / "mha-s1337")
    shutil.copy(seeds_sweep.out / "compare.json", out)  # the mark of a comparison's folder
    assert "1 runs, 0 to run" in run([*args, "--mode=plan"]).stdout  # this sweep's run, finished
    log = out / "mha-s1337" / "log.jsonl"
    lines = log.read_text().splitlines()
    final = json.loads(lines[-1])
    assert (final["event"], final["iter"]) == ("eval", 30)
    log.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])  # cut in half
    assert "1 runs, 1 to run" in run([*args, "--mode=plan"]).stdout
    r = run(args, env={"WANDB_MODE": "disabled"})
    assert f"--out_dir={out / 'mha-s1337'} --init_from=resume --eval_only=True" in r.stdout
    evals = read_run(out / "mha-s1337")[
        "evals"
    ]  # the same model's loss again (to float rounding: another process)
    assert [e["iter"] for e in evals] == [0, 10, 20, 30] and evals[-1]["val_loss"] == pytest.approx(
        final["val_loss"], abs=1e-4
    )
    assert (
        float(next(csv.DictReader(open(out / "report.csv")))["val_loss"]) == evals[-1]["val_loss"]
    )
    assert (
        "1 of 1 runs already finished"
        in run([*args, "--mode=train"], env={"WANDB_MODE": "disabled"}).stdout
    )


def alive(pid: int) -> bool:
    """Whether process pid runs (a zombie, ended but not reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except (FileNotFoundError, ProcessLookupError):
        return False


def start_sweep(args: list[str]) -> tuple[subprocess.Popen, int, str]:
    """compare.py with args in a process of its own, once its train.py child has logged training
    progress; that child's pid, and the output so far."""
    p = subprocess.Popen(
        [sys.executable, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ | {"PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"},
    )
    head = ""
    for line in p.stdout:
        head += line
        if line.startswith("iter "):
            break
    children = [
        int(d.name)
        for d in Path("/proc").glob("[0-9]*")
        if alive(int(d.name))
        and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == p.pid
    ]
    assert len(children) == 1, (children, p.poll(), head)
    return p, children[0], head


def stop_sweep(p: subprocess.Popen, child: int, sig: signal.Signals) -> tuple[str, str]:
    """Send compare.py sig; its stdout and stderr once it ended (both processes killed, whatever
    happened)."""
    try:
        p.send_signal(sig)
        return p.communicate(timeout=60)
    finally:
        for pid in (p.pid, child):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow  # 5 processes
@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="finds compare.py's train.py through /proc"
)
def test_sigterm_and_sigint_stop_the_sweep_with_its_run_and_a_later_sweep_resumes(
    pycode_small: Path, tmp_path: Path
) -> None:
    out = tmp_path / "cmp"
    args = [
        "compare.py",
        f"--dataset={pycode_small}",
        f"--out_dir={out}",
        *SWEEP,
        "--kv_heads=[4]",
        # each sweep is stopped at its first progress line (iteration 10, then 20 resumed): the
        # sweep run last trains the rest
        "--max_iters=100",
        "--eval_interval=50",
    ]
    for sig in (signal.SIGTERM, signal.SIGINT):
        p, child, head = start_sweep(args)
        stdout, stderr = stop_sweep(p, child, sig)
        stdout = head + stdout
        assert p.returncode == 128 + sig and f"stopping on {sig.name} at iteration" in stdout
        assert [line for line in stderr.splitlines() if "stopped" in line] == [
            f"stopped by {sig.name} in {out / 'mha-s1337'} (run 1 of the 1 left): 0 of 1 runs "
            f"finished; run the same command again to resume (a run cut short goes on from its "
            f"checkpoint)"
        ]
        assert not alive(child)
        assert ("--init_from=resume" in stdout) == (
            sig == signal.SIGINT
        )  # the second sweep resumed the first's
    r = run([*args, "--mode=train"], env={"WANDB_MODE": "disabled"})
    assert f"--out_dir={out / 'mha-s1337'} --init_from=resume" in r.stdout
    assert [e["iter"] for e in read_run(out / "mha-s1337")["evals"]] == [0, 50, 100]


@pytest.mark.slow  # 2 processes
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_killing_compare_ends_its_train_py_which_saves_first(
    pycode_small: Path, tmp_path: Path
) -> None:
    out = tmp_path / "cmp"
    p, child, _ = start_sweep(
        [
            "compare.py",
            f"--dataset={pycode_small}",
            f"--out_dir={out}",
            *SWEEP,
            "--kv_heads=[4]",
            "--max_iters=100000",
            "--eval_interval=100000",
        ]
    )  # minutes of training, unstopped
    try:
        p.kill()
        p.wait(timeout=10)
        deadline = time.time() + 10
        while alive(child) and time.time() < deadline:
            time.sleep(0.05)
        assert not alive(child)
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)
        p.stdout.close()
        p.stderr.close()
    # SIGTERM: it saved and ended
    assert 0 < load_checkpoint(out / "mha-s1337" / "ckpt.pt")["iter_num"] < 100000


def test_sizes_repeat_the_sweep_per_size_in_the_plan(pycode_small: Path, tmp_path: Path) -> None:
    r = run(
        [
            "compare.py",
            f"--dataset={pycode_small}",
            f"--out_dir={tmp_path / 'cmp'}",
            *SWEEP,
            "--kv_heads=[4,1]",
            "--sizes=[tiny,1x16,3x48]",
            "--seeds=2",
            "--mode=plan",
        ]
    )
    names = [
        line.split("|")[1].strip() for line in r.stdout.splitlines()[2:] if line.startswith("| ")
    ]
    sizes = ("2x64", "1x16", "3x48")
    assert names == [
        f"{size}-{v}-s{s}" for size in sizes for s in (1337, 1338) for v in ("mha", "mqa")
    ]
    assert "12 runs, 12 to run: about" in r.stdout and not (tmp_path / "cmp").exists()
    r = run(
        [
            "compare.py",
            f"--dataset={pycode_small}",
            f"--out_dir={tmp_path / 'cmp'}",
            *SWEEP,
            "--kv_heads=[4]",
            "--sizes=[(1,16),(2,64)]",
            "--mode=plan",
        ]
    )  # (n_layer, n_embd) pairs
    assert "| 1x16-mha-s1337 |" in r.stdout and "| 2x64-mha-s1337 |" in r.stdout


def test_a_sweep_over_rates_trains_each_variant_at_each_and_reports_each_at_its_best(
    pycode_small: Path, tmp_path: Path
) -> None:
    """--lrs=[3e-4,1e-2,1e30]: a plan of 2 variants x 3 rates, then the sweep: each run at its rate
    (min_lr in the base run's proportion, 1e-4 to 3e-3), 1e30 diverging without stopping the
    sweep, and the report's row for each variant at the rate of its lower final val loss, its loss
    the test loss that run logged; run again, the sweep trains nothing (a diverged run is done)."""
    out = tmp_path / "cmp"
    args = [
        "compare.py",
        f"--dataset={pycode_small}",
        f"--out_dir={out}",
        *SWEEP,
        "--variants=[mha,mqa]",
        "--lrs=[3e-4,1e-2,1e30]",
        "--max_iters=20",
    ]
    r = run([*args, "--mode=plan"])
    assert "6 runs, 6 to run: about" in r.stdout and "| mqa-lr0.01-s1337 |" in r.stdout
    r = run(args, env={"WANDB_MODE": "disabled"})
    assert r.stdout.count("diverged at rate 1e+30: the report counts it so") == 2
    rows = {row["variant"]: row for row in csv.DictReader(open(out / "report.csv"))}
    for name in ("mha", "mqa"):
        finals = {}
        for rate, min_lr in (("0.0003", 1e-5), ("0.01", 1e-2 / 30)):
            log = read_log(out / f"{name}-lr{rate}-s1337")
            assert log[0]["config"]["learning_rate"] == float(rate)
            assert log[0]["config"]["min_lr"] == pytest.approx(min_lr, rel=1e-5)
            assert f"lr={rate}" in log[0]["config"]["wandb_tags"]
            finals[rate] = [e for e in log if e["event"] == "eval"][-1]
        best = min(finals, key=lambda rate: finals[rate]["val_loss"])
        row = rows[name]
        assert (row["lr"], row["split"]) == (best, "test")
        assert float(row["test_loss"]) == finals[best]["test_loss"] != finals[best]["val_loss"]
        assert float(row["val_loss"]) == finals[best]["val_loss"]
        assert row["val_loss_by_lr"].endswith(" 1e+30:inf")
    assert "| lr (chosen on val) |" in (out / "report.md").read_text()
    r = run([*args, "--mode=train"], env={"WANDB_MODE": "disabled"})
    assert "6 of 6 runs already finished" in r.stdout and "$ python train.py" not in r.stdout


def test_bracket_trains_a_variant_best_at_an_edge_a_step_further_until_the_limit(
    pycode_small: Path, tmp_path: Path
) -> None:
    """--lrs=[1e-5,3e-5] --bracket=2, 20 iterations: the higher rate is best, at the grid's top
    edge, so MHA's seed trains at 9e-5 (a grid step of 3 further), then, still best at the edge, at
    3e-4 (2.7e-4 as rates are written), and no further (2 steps). The plan names the grid and says
    what may follow; the report takes the rate of lowest val loss among all four, its table lists
    the rates in order and says the choice is still at an edge; run again, nothing trains, and
    --mode=report reads the same four runs."""
    out = tmp_path / "cmp"
    args = [
        "compare.py",
        f"--dataset={pycode_small}",
        f"--out_dir={out}",
        *SWEEP,
        "--variants=[mha]",
        "--lrs=[1e-5,3e-5]",
        "--bracket=2",
        "--max_iters=20",
    ]
    r = run([*args, "--mode=plan"])
    assert "2 runs, 2 to run: about" in r.stdout and "bracket=2: then" in r.stdout
    r = run(args, env={"WANDB_MODE": "disabled"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("runs past an edge of the rates (bracket)") == 2
    rates = ["1e-05", "3e-05", "9e-05", "0.0003"]
    assert sorted(d.name for d in out.glob("mha-lr*")) == sorted(f"mha-lr{x}-s1337" for x in rates)
    finals = {}
    for rate in rates:
        log = read_log(out / f"mha-lr{rate}-s1337")
        assert log[0]["config"]["learning_rate"] == float(rate)
        # min_lr in the base run's proportion, as at the grid's rates
        proportion = log[0]["config"]["min_lr"] / float(rate)
        assert proportion == pytest.approx(finals.get("proportion", proportion), rel=1e-4)
        finals["proportion"] = proportion
        finals[rate] = [e for e in log if e["event"] == "eval"][-1]["val_loss"]
    assert finals["proportion"] < 1
    # each step was taken because the rate before it was the best so far, at the top
    assert finals["1e-05"] > finals["3e-05"] > finals["9e-05"] > finals["0.0003"]
    (row,) = csv.DictReader(open(out / "report.csv"))
    assert row["lr"] == "0.0003" and row["val_loss_by_lr"].split()[-1].startswith("0.0003:")
    text = (out / "report.md").read_text()
    assert "| variant | 1e-05 | 3e-05 | 9e-05 | 0.0003 |" in text
    assert "At an edge of the rates it trained at" in text and "--bracket): mha." in text
    r = run([*args, "--mode=train"], env={"WANDB_MODE": "disabled"})
    assert "4 of 4 runs already finished" in r.stdout and "$ python train.py" not in r.stdout
    r = run([*args, "--mode=report"])
    assert r.returncode == 0 and "unfinished" not in r.stderr and "not named" not in r.stderr


def test_bracket_steps_are_grid_steps_written_as_rates_are() -> None:
    """A step past the grid is the ratio of its two rates at that end, written with the fewest
    significant digits that keep it half a step from every rate tried; --bracket needs two
    different rates."""
    assert rate_bracket.grid_steps(parse_config(CompareConfig, ["--lrs=[3e-3,1e-3,1e-2]"])) == (
        pytest.approx(1 / 3),
        pytest.approx(10 / 3),
    )
    assert rate_bracket.next_rate(1e-3, 1 / 3, [1e-3, 3e-3]) == 3e-4
    assert rate_bracket.next_rate(3e-3, 3, [1e-3, 3e-3]) == 9e-3
    assert rate_bracket.next_rate(6e-3, 2, [1.5e-3, 3e-3, 6e-3]) == 1e-2  # 1.2e-2
    assert rate_bracket.next_rate(1.5e-3, 1 / 2, [1.5e-3, 3e-3, 6e-3]) == 8e-4  # 7.5e-4
    # one digit would give 1e-3, a rate tried: two
    assert rate_bracket.next_rate(1.1e-3, 1.1, [1e-3, 1.1e-3]) == 1.2e-3
    for argv in (
        ["--bracket=1", "--lrs=[1e-3]"],
        ["--bracket=1", "--lrs=[1e-3,1e-3]", "--muon_lrs=[0.01,0.02]"],
        ["--bracket=-1"],
    ):
        with pytest.raises(UserError, match="bracket="):
            parse_config(CompareConfig, argv)


def test_rates_give_muon_its_own_or_a_scaled_rate() -> None:
    """With Muon, each of --lrs scales the base muon_lr as it scales learning_rate, unless
    --muon_lrs gives Muon's rates apart (then the folders name both)."""
    base = parse_config(TrainConfig, ["--optimizer=muon", "--learning_rate=1e-3", "--muon_lr=0.02"])
    scaled = sweep.rates(parse_config(CompareConfig, ["--lrs=[5e-4,2e-3]"]), base)
    assert [r.flags[-1] for r in scaled] == ["--muon_lr=0.01", "--muon_lr=0.04"]
    assert [r.folder for r in scaled] == ["lr0.0005", "lr0.002"]
    apart = sweep.rates(
        parse_config(CompareConfig, ["--lrs=[1e-3,1e-3]", "--muon_lrs=[0.01,0.03]"]), base
    )
    assert [r.flags[-1] for r in apart] == ["--muon_lr=0.01", "--muon_lr=0.03"]
    assert [(r.label, r.folder) for r in apart] == [
        ("0.001/0.01", "lr0.001-mlr0.01"),
        ("0.001/0.03", "lr0.001-mlr0.03"),
    ]
    assert sweep.rates(parse_config(CompareConfig, []), base) == [None]


def test_a_plan_without_mha_says_up_front_that_the_report_has_no_difference_to_it(
    pycode_small: Path, tmp_path: Path
) -> None:
    r = run(
        [
            "compare.py",
            f"--out_dir={tmp_path / 'cmp'}",
            *SWEEP,
            f"--dataset={pycode_small}",
            "--kv_heads=[2,1]",
            "--mode=plan",
        ]
    )
    assert r.stdout.startswith(
        "no MHA in kv_heads=[2, 1] (n_head=4): the report compares these variants but shows no "
        "difference to MHA; add 4 to kv_heads for that\n"
    )
    assert "2 runs, 2 to run" in r.stdout


def test_variants_name_mla_beside_the_others_with_their_flags_conversions_and_costs(
    pycode_small: Path, tmp_path: Path
) -> None:
    """--variants names each variant and its size; an MLA variant is trained with its
    kv_lora_rank, matched to MHA's parameters by its MLP like the others, converted from MHA by
    the SVD (no latent norm, no K/V pooling method), and listed by --mode=costs with its cache of
    kv_lora_rank + qk_rope_head_dim values a token and layer."""
    out = tmp_path / "cmp"
    r = run(
        [
            "compare.py",
            f"--out_dir={out}",
            *SWEEP,
            f"--dataset={pycode_small}",
            "--pos_encoding=rope",
            "--variants=[mha,gqa2,mla16]",
            "--match=params",
            "--convert=True",
            "--uptrain_fractions=[0.1]",
            "--mode=plan",
        ]
    )
    names = [
        line.split("|")[1].strip() for line in r.stdout.splitlines()[2:] if line.startswith("| ")
    ]
    assert names == [
        "mha-s1337",
        "gqa2-params-s1337",
        "mla16-params-s1337",
        "mha-to-gqa2-mean-u0.1-s1337",
        "mha-to-mla16-svd-u0.1-s1337",
    ]
    train_args = [a for a in SWEEP if not a.startswith(("--decode", "--speed"))] + [
        "--pos_encoding=rope"
    ]
    base = parse_config(TrainConfig, [f"--out_dir={out}", *train_args])
    cfg = parse_config(
        CompareConfig,
        [
            "--variants=[mha,gqa2,mla16]",
            "--match=params",
            "--convert=True",
            "--uptrain_fractions=[0.1]",
        ],
    )
    runs = {run.name: run for run in sweep.plan(cfg, base, 96, out)}
    mla = runs["mla16-params"]
    assert "--kv_lora_rank=16" in mla.args and mla.model.attention_type == "MLA"
    with torch.device("meta"):
        mha_params = GPT(runs["mha"].model).num_params()
        assert abs(GPT(mla.model).num_params() - mha_params) <= 0.01 * mha_params
    assert (
        f"--mlp_hidden={mla.model.mlp_hidden}" in mla.args
        and mla.model.mlp_hidden != runs["mha"].model.mlp_hidden
    )
    conv = runs["mha-to-mla16-svd-u0.1"]
    assert {
        "--kv_lora_rank=16",
        "--latent_norm=False",
        f"--init_from=convert:{out / 'mha-s1337'}",
    } <= set(conv.args)
    tags = next(a for a in conv.args if a.startswith("--wandb_tags="))
    assert not any(a.startswith("--convert_method") for a in conv.args) and "convert=svd" in tags
    r = run(
        [
            "compare.py",
            "--mode=costs",
            "--n_head=4",
            "--n_embd=32",
            "--n_layer=2",
            "--block_size=64",
            "--vocab_size=50",
            "--pos_encoding=rope",
            "--variants=[mha,mla16]",
            "--kv_dtype=float32",
        ]
    )
    mla_row = next(line for line in r.stdout.splitlines() if "MLA (kv_lora_rank=16)" in line)
    assert mla_row.split("|")[-2].strip() == str(
        round(2 * 64 * (16 + 4) * 4 / 2**20, 2)
    )  # 2 layers, d_c + d_R


def test_convert_makes_hybrids_of_the_mha_model_and_distills_them_on_request(
    tmp_path: Path,
) -> None:
    """--convert reaches hybrids of global attention and Gated DeltaNet: mha-dl copied, gqa2-dl
    pooled by each method, both with --layer_pattern and, with --uptrain_distill=logits, the KL
    to the MHA run where they uptrain (a '-kl' name; uptrained 0 iterations, the conversion
    alone); a windowed hybrid trains from scratch only. train.py's conversion keys reach the runs
    that read them: the hybrid's the conversions into a hybrid, the teacher's the distilling runs.
    The report finds each conversion's variant from scratch by its name."""
    from smallgpt.plots import conversion_target

    out = tmp_path / "cmp"
    base = parse_config(TrainConfig, [f"--out_dir={out}", *TINY_TRAIN, "--max_iters=30"])
    cfg = parse_config(
        CompareConfig,
        [
            "--variants=[mha,mha-dl,gqa2-dl,mha-sl8]",
            "--convert=True",
            "--convert_methods=[mean,first]",
            "--uptrain_fractions=[0,0.1]",
            "--uptrain_distill=logits",
        ],
    )
    steering = ["--convert_layers=kl", "--distill_ce=0.5"]
    cfg = dataclasses.replace(cfg, conversion_args=steering)
    runs = {run.name: run for run in sweep.plan(cfg, base, 96, out)}
    converted = sorted(name for name in runs if name.startswith("mha-to-"))
    assert converted == [
        "mha-to-gqa2-dl-first-u0",
        "mha-to-gqa2-dl-first-u0.1-kl",
        "mha-to-gqa2-dl-mean-u0",
        "mha-to-gqa2-dl-mean-u0.1-kl",
        "mha-to-mha-dl-copy-u0",
        "mha-to-mha-dl-copy-u0.1-kl",
    ]
    alone = runs["mha-to-mha-dl-copy-u0"].args
    assert "--convert_layers=kl" in alone
    assert not any(a.startswith(("--distill", "--teacher")) for a in alone)
    assert not any(a in steering for a in runs["mha-sl8"].args + runs["mha"].args)
    copied = runs["mha-to-mha-dl-copy-u0.1-kl"]
    assert {
        "--layer_pattern=DL",
        "--distill=logits",
        *steering,
        f"--init_from=convert:{out / 'mha-s1337'}",
    } <= set(copied.args)
    assert not any(a.startswith("--convert_method") for a in copied.args)
    pooled = runs["mha-to-gqa2-dl-first-u0.1-kl"]
    assert {"--convert_method=first", "--n_kv_head=2", "--layer_pattern=DL"} <= set(pooled.args)
    for name, method in (
        ("mha-to-mha-dl-copy-u0.1-kl", "copy"),
        ("mha-to-gqa2-dl-first-u0", "first"),
    ):
        assert conversion_target({"variant": name, "method": method}) == name.split("-")[2] + "-dl"


def test_a_distilled_conversion_sweep_resumes_with_its_own_command_even_moved(
    pycode_small: Path, tmp_path: Path
) -> None:
    """MHA converted into mha-dl and uptrained by distillation: the same command again (and with
    --mode=plan) trains nothing and is not refused over the teacher its conversion set for itself;
    so does the sweep moved to another folder. The report says the uptraining distilled."""
    out = tmp_path / "cmp"
    sweep_args = [
        f"--dataset={pycode_small}",
        *SWEEP,
        "--variants=[mha,mha-dl]",
        "--convert=True",
        "--uptrain_fractions=[0.5]",
        "--uptrain_distill=logits",
    ]
    quiet = {"WANDB_MODE": "disabled"}
    run(["compare.py", f"--out_dir={out}", *sweep_args], env=quiet)
    report = (out / "report.md").read_text()
    assert "uptrained 0.5 by distillation (KL to the teacher's logits)" in report
    converted = out / "mha-to-mha-dl-copy-u0.5-kl-s1337" / "ckpt.pt"
    saved = converted.stat().st_mtime_ns
    run(["compare.py", f"--out_dir={out}", *sweep_args], env=quiet)
    assert converted.stat().st_mtime_ns == saved
    moved = tmp_path / "moved"
    shutil.move(out, moved)
    for folder in (moved,):
        r = run(["compare.py", f"--out_dir={folder}", *sweep_args, "--mode=plan"], env=quiet)
        assert "3 runs, 0 to run" in r.stdout, r.stdout
    run(["compare.py", f"--out_dir={moved}", *sweep_args, "--mode=report"], env=quiet)


def test_variants_name_local_layers_by_pattern_and_window(
    pycode_small: Path, tmp_path: Path
) -> None:
    """mha-sl8 is MHA with window_pattern='SL', window=8 (its name, folder, flags and model),
    gqa2-s4 GQA with local layers of 4; a conversion is to an all-global variant only (a windowed
    one is trained from scratch)."""
    out = tmp_path / "cmp"
    variants = "--variants=[mha,gqa2,mha-sl8,gqa2-s4]"
    r = run(
        [
            "compare.py",
            f"--out_dir={out}",
            *SWEEP,
            f"--dataset={pycode_small}",
            "--n_layer=3",
            variants,
            "--convert=True",
            "--uptrain_fractions=[0.1]",
            "--mode=plan",
        ]
    )
    names = [
        line.split("|")[1].strip() for line in r.stdout.splitlines()[2:] if line.startswith("| ")
    ]
    assert names == [
        "mha-s1337",
        "gqa2-s1337",
        "mha-sl8-s1337",
        "gqa2-s4-s1337",
        "mha-to-gqa2-mean-u0.1-s1337",
    ]
    train_args = [a for a in SWEEP if not a.startswith(("--decode", "--speed"))] + ["--n_layer=3"]
    base = parse_config(TrainConfig, [f"--out_dir={out}", *train_args])
    runs = {
        run.name: run for run in sweep.plan(parse_config(CompareConfig, [variants]), base, 96, out)
    }
    assert (
        runs["mha-sl8"].model.layer_windows == [8, None, None]
        and runs["mha"].model.layer_windows == [None] * 3
    )
    assert {"--n_kv_head=4", "--window=8", "--window_pattern=SL"} <= set(runs["mha-sl8"].args)
    assert (
        runs["gqa2-s4"].model.layer_windows == [4, 4, None] and runs["gqa2-s4"].model.n_kv_head == 2
    )
    assert not any(a.startswith("--window") for a in runs["gqa2"].args)
    assert [str(Variant.from_config(run.model)) for run in runs.values()] == [
        "mha",
        "gqa2",
        "mha-sl8",
        "gqa2-s4",
    ]
    r = run(
        [
            "compare.py",
            "--mode=costs",
            "--n_head=4",
            "--n_embd=32",
            "--n_layer=3",
            "--block_size=4096",
            "--vocab_size=50",
            "--variants=[mha,mha-sl8]",
            "--kv_dtype=float32",
        ]
    )
    row = next(line for line in r.stdout.splitlines() if "MHA, window 8 in SL" in line)
    # 1 local, 2 global
    assert float(row.split("|")[-2]) == round((8 + 2 * 4096) * 2 * 4 * 8 * 4 / 2**20, 2) != 3


@pytest.mark.parametrize(
    "name",
    ["mha", "gqa2", "mqa", "mla16", "mha-sssl64", "gqa2-sssl64", "mqa-sssl64", "mla16-sssl64"],
)
def test_a_variant_name_round_trips_through_variant_and_its_model(name: str) -> None:
    """The names' one grammar: Variant.parse reads what str(Variant) writes, and the model a name
    makes of an all-global MHA model is named back as the same variant (from its attention_type)."""
    variant = Variant.parse(name)
    assert str(variant) == format(variant) == f"{variant}" == name
    assert Variant.parse(format(variant)) == variant
    mha = GPTConfig(n_layer=4, n_head=4, n_embd=32, block_size=128, vocab_size=50)
    model = variant.config(mha)
    assert Variant.from_config(model) == variant
    assert model.attention_type == variant.attention.upper()
    assert (model.window, model.window_pattern) == ((64, "SSSL") if "-" in name else (None, "L"))


@pytest.mark.parametrize("name", ["MHA", "gqa0", "gqa", "mla", "mqa2", "mha-x8", "mha-s", "mha-"])
def test_a_name_of_no_variant_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="is not a variant name"):
        Variant.parse(name)


@pytest.mark.slow  # 1 train.py process
def test_a_windowed_variant_trains_and_the_report_counts_its_cache_per_layer(
    pycode_small: Path, tmp_path: Path
) -> None:
    """The report's KV column (one sequence of decode_context = 40 tokens, bf16) counts the local
    layer's window of 8 and the global layer's 40 positions; the decode speed is measured for the
    windowed shape itself."""
    out = tmp_path / "cmp"
    run(
        [
            "compare.py",
            f"--dataset={pycode_small}",
            f"--out_dir={out}",
            *SWEEP,
            "--variants=[mha-s8]",
            "--max_iters=10",
        ],
        env={"WANDB_MODE": "disabled"},
    )
    (row,) = csv.DictReader(open(out / "report.csv"))
    assert row["variant"] == "mha-s8" and int(row["decode_repeats"]) == 2
    # positions x K and V x heads x head_dim x 2
    assert int(row["kv_bytes@40_bfloat16"]) == (8 + 40) * 2 * 4 * 8 * 2
    assert read_log(out / "mha-s8-s1337")[0]["model_config"]["window"] == 8
    assert [key for key in json.loads((out / "speed.json").read_text())["speeds"]] == [
        "2x32-h4-kv4-mlp128-learned-s8@40x2"
    ]
    assert "| mha-s8 |" in (out / "report.md").read_text()


def test_stored_decode_speeds_are_reused_only_with_the_settings_that_measured_them(
    tmp_path: Path,
) -> None:
    """speed.json records what its speeds were measured with (the device by name, threads, torch,
    decode_steps): a sweep reuses them with the same, and measures every shape again with any
    other, or where a file from before the record says nothing of them."""
    import compare
    from smallgpt import report

    cfg, base = compare.parse([*SWEEP, f"--out_dir={tmp_path}", "--kv_heads=[4]"])
    cfg.speed_repeats = 1
    runs = sweep.plan(cfg, base, 61, tmp_path)
    key = report.speed_key(runs[0].model, cfg.decode_context, cfg.decode_batch)
    now = report.speed_settings(cfg, "cpu")
    assert now["device"] and now["decode_steps"] == 3
    path = tmp_path / "speed.json"
    path.write_text(json.dumps({"measured_with": now, "speeds": {key: [1.5]}}))
    compare.measure_speeds(cfg, runs, tmp_path, "cpu")
    assert json.loads(path.read_text())["speeds"] == {key: [1.5]}  # the same settings: reused
    elsewhere = {"measured_with": now | {"device": "another CPU"}, "speeds": {key: [1.5]}}
    for stored in (elsewhere, {key: [1.5]}):
        path.write_text(json.dumps(stored))
        compare.measure_speeds(cfg, runs, tmp_path, "cpu")
        measured = json.loads(path.read_text())
        assert measured["measured_with"] == now
        assert list(measured["speeds"]) == [key] and measured["speeds"][key] != [1.5]


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        ("--kv_dtype=bogus", "kv_dtype='bogus' must be"),
        ("--decode_steps=0", "decode_steps=0: must be positive"),
        ("--kv_heads=[0]", "kv_heads=[0] must be positive"),
        ("--seeds=0", "seeds=0: must be positive"),
        ("--match=size", "match=['size'] must be width, params"),
        (
            "--convert=True --convert_methods=[mean,best]",
            "convert_methods=['mean', 'best']: each must be one of mean",
        ),
        (
            "--convert=True --uptrain_fractions=[0,1.5]",
            "uptrain_fractions=[0.0, 1.5]: each must be in [0, 1]",
        ),
        ("--convert_methods=[first]", "convert_methods given without --convert=True"),
        ("--lrs=[1e-3,-1]", "rates must be positive"),
        ("--lrs=[1e-3,0.001]", "lists 0.001 twice"),
        (
            "--optimizer=muon --lrs=[1e-3,3e-3] --muon_lrs=[0.02]",
            "give one Muon rate for each of lrs",
        ),
        ("--lrs=[1e-3] --muon_lrs=[0.02]", "Muon's rates need --optimizer=muon"),
        ("--convert=True --lrs=[1e-3,3e-3]", "convert=True with lrs=[0.001, 0.003]"),
        ("--convert=True --kv_heads=[2,1]", "kv_heads=[2, 1] must hold n_head=4"),
        (
            "--sizes=[2x30]",
            "sizes: 2x30: invalid GPTConfig: n_embd=30 must be divisible by n_head=4",
        ),
        ("--sizes=[huge]", "sizes: 'huge' is neither n_layer x n_embd"),
        (
            "--sizes=[0x64]",
            "sizes: '0x64' is neither n_layer x n_embd (two positive decimal integers",
        ),  # not 100
        (
            "--sizes=[(0,64)]",
            "sizes: [0, 64] is neither n_layer x n_embd (two positive decimal integers",
        ),
        (
            "--kv_heads=[2,2]",
            "kv_heads=[2, 2] lists 2 twice: each item names its own runs, so a repeat would train",
        ),
        ("--match=[width,width]", "match=['width', 'width'] lists width twice"),
        ("--sizes=[mini,4x128]", "sizes=['mini', '4x128'] lists 4x128 twice"),
        (
            "--convert=True --convert_methods=[mean,mean]",
            "convert_methods=['mean', 'mean'] lists mean twice",
        ),
        (
            "--convert=True --uptrain_fractions=[0.1,0.1]",
            "uptrain_fractions=[0.1, 0.1] lists 0.1 twice",
        ),
        (
            "--convert=True --uptrain_fractions=[0.1,0.11]",
            "uptrain_fractions=[0.1, 0.11] give 3 of max_iters=30 iterations twice",
        ),
        ("--n_head=6 --n_embd=48 --kv_heads=[6,4]", "n_head=6 must be divisible by n_kv_head=4"),
        (
            "--match=params --n_embd=4 --n_head=4 --n_layer=1 --vocab_size=2 --block_size=2 "
            "--bias=True",
            "match=params: no MLP width gives mqa at 1x4 MHA's",
        ),
        (
            "--variants=[mha,mla]",
            "variants: mla is not mha, gqa<n_kv_head>, mqa or mla<kv_lora_rank>",
        ),
        (
            "--variants=[mha,mha-x8,mha-s]",
            "variants: mha-x8, mha-s is not mha, gqa<n_kv_head>, mqa or mla<kv_lora_rank>, "
            "each with -<window_pattern><window> for local layers or without",
        ),
        ("--variants=[mha,mha-ll8]", "window=8 with window_pattern='LL': no layer is local"),
        (
            "--window=8 --window_pattern=SL",
            "window=8 in the base run: compare.py gives each variant its local layers by "
            "name, e.g. --variants=[mha,mha-sl8]",
        ),
        ("--variants=[mha,gqa0,mla16]", "variants: gqa0 is not mha"),
        (
            "--variants=[mha,mha-qknorm-gate]",
            "variants: mha-qknorm-gate: a name's parts go in the order kind, pattern, -gate or "
            "-headgate, -qknorm, -rope<percent>, -sink, -nope or -rp<letters>: mha-gate-qknorm",
        ),
        ("--variants=[mha,mha-sink-gate]", "mha-sink-gate: a name's parts go in the order"),
        ("--variants=[mha,mha-rprn-sink]", "-nope or -rp<letters>: mha-sink-rprn"),
        ("--variants=[mha,mha-sinks]", "then -gate or -headgate, -qknorm, -rope<percent>"),
        ("--variants=[mha,mha-sinks]", "-sink, and -nope or -rp<letters of R and N"),
        ("--lm_eval_limit=5", "lm_eval_limit=5 is read by lm_eval's tasks, and lm_eval=[]"),
        # train.py's conversion keys reach the conversion runs that read them, or are refused
        ("--convert_layers=kl", "convert_layers steers train.py's conversions and this sweep"),
        (
            "--convert=True --variants=[mha,gqa2] --convert_calibrate=False",
            "convert_calibrate steers the conversion into a hybrid, and no variant converted is",
        ),
        (
            "--convert=True --variants=[mha,mha-dl] --teacher=x --distill_ce=1",
            "teacher, distill_ce steer a distillation and the conversions uptrain on the data",
        ),
        (
            "--convert=True --variants=[mha,mha-dl] --uptrain_fractions=[0] "
            "--uptrain_distill=logits",
            "uptrain_distill='logits' distills while uptraining, and uptrain_fractions=[0.0]",
        ),
        (
            "--convert_method=first",
            "convert_method='first' in the base run: compare.py converts with --convert=True by "
            "each of --convert_methods",
        ),
        ("--variants=[mha,mqa-rope50-dl]", "mqa-rope50-dl: a name's parts go in the order"),
        ("--kv_heads=[4] --match=[width,params]", "match=['width', 'params']: params widens each"),
        ("--variants=[mha] --kv_heads=[4]", "kv_heads=[4] and variants=['mha']: give one of them"),
        ("--variants=[mla16,mla16]", "variants=['mla16', 'mla16'] lists mla16 twice"),
        (
            "--variants=[mha,gqa3]",
            "variants=['mha', 'gqa3'] at 2x32: invalid GPTConfig: n_head=4 must be divisible by "
            "n_kv_head=3",
        ),
        (
            "--variants=[mha,mla16] --pos_encoding=rope --n_embd=24 --n_head=4",
            "needs an even qk_rope_head_dim, got qk_rope_head_dim=3",
        ),
        ("--convert=True --variants=[mqa,mla16]", "variants=['mqa', 'mla16'] must hold mha"),
        (
            "--convert=True --variants=[mha,mla48] --pos_encoding=rope",
            "convert=True to mla48 at 2x32: kv_lora_rank=48 exceeds n_embd=32",
        ),
        (
            "--convert=True --variants=[mha,mla16] --pos_encoding=rope --qk_rope_head_dim=6",
            "qk_rope_head_dim=6 is an MLA key",
        ),
        # a name in another case says the case meant; two names of one model, or a name of another
        (
            "--variants=[MQA,gqa2-S8]",
            "variants: MQA, gqa2-S8: variant names are lower case: mqa, gqa2-s8",
        ),
        ("--variants=[mha,Mla16]", "variants: Mla16: variant names are lower case: mla16"),
        (
            "--variants=[mqa,gqa1]",
            "variants=['mqa', 'gqa1']: mqa and gqa1 are the same model at 2x32 (MQA, n_kv_head=1): "
            "list one of them",
        ),
        (
            "--variants=[mha-s8,mha-sl8]",
            "mha-s8 and mha-sl8 are the same model at 2x32 (MHA, n_kv_head=4, layer windows "
            "[8, None])",
        ),
        ("--variants=[gqa4,mqa]", "variants=['gqa4', 'mqa']: gqa4 is mha at n_head=4: name it mha"),
        # a key that the names decide, or an MLA key, given to the base run: that key, and the names
        (
            "--kv_lora_rank=16",
            "kv_lora_rank=16 in the base run: compare.py makes MLA a variant of its own, named "
            "mla<kv_lora_rank>, e.g. --variants=[mha,mla16]",
        ),
        (
            "--n_kv_head=2",
            "n_kv_head=2 in the base run: compare.py gives each variant its K/V heads by name",
        ),
        (
            "--window_pattern=SSL",
            "window_pattern='SSL' in the base run: compare.py gives each variant its local layers "
            "by name, e.g. --variants=[mha,mha-ssl64]",
        ),
        (
            "--q_lora_rank=8 --variants=[mha,mla16]",
            "q_lora_rank=8 is an MLA key, and compare.py's base run",
        ),
        ("--latent_norm=False", "latent_norm=False is an MLA key, and compare.py's base run"),
        # what a run cannot train on, before the first: the dataset's tokens, final_evals
        ("--vocab_size=10", "mha-s1337: the model's vocab_size=10 is smaller than dataset"),
        ("--final_evals=[induction] --block_size=7", "mha-s1337: final_evals=['induction']: "),
        (
            "--final_evals=[position,mqar] --mode=plan",
            "mha-s1337: final_evals=['position', 'mqar']: the mqar task reads an MQAR dataset",
        ),
    ],
)
def test_bad_sweep_settings_are_one_line_before_any_training(
    pycode_small: Path, tmp_path: Path, arg: str, message: str
) -> None:
    r = cli(
        [
            "compare.py",
            f"--dataset={pycode_small}",
            f"--out_dir={tmp_path / 'cmp'}",
            *SWEEP,
            *arg.split(),
        ]
    )
    assert r.returncode == 2 and r.stderr.startswith("error: ") and message in r.stderr, r.stderr
    assert len(r.stderr.splitlines()) == 1 and not (tmp_path / "cmp").exists()


@pytest.mark.parametrize(
    ("kv_dtype", "nbytes"), [(None, 2), ("float32", 4)]
)  # the default: bfloat16
def test_costs_table_lists_every_divisor(kv_dtype: str | None, nbytes: int) -> None:
    """Every column of every n_kv_head that divides n_head, against closed forms written out here
    (no bias, learned positions, the MLP 4 wide, lm_head tied to the token embedding)."""
    D, H, L, V, T = 384, 6, 2, 1000, 1024
    r = run(
        [
            "compare.py",
            "--mode=costs",
            f"--n_head={H}",
            f"--n_embd={D}",
            f"--n_layer={L}",
            f"--block_size={T}",
            f"--vocab_size={V}",
            *([f"--kv_dtype={kv_dtype}"] * bool(kv_dtype)),
        ]
    )
    lines = [
        [c.strip() for c in line.split("|")[1:-1]]
        for line in r.stdout.splitlines()
        if line.startswith("|")
    ]
    header, rows = lines[0], [dict(zip(lines[0], cells, strict=True)) for cells in lines[2:]]
    kv_column = f"KV cache/sequence @ {T} ({kv_dtype or 'bfloat16'}, MiB)"
    assert header == ["n_kv_head", "kind", "params (M)", "attention params/layer", kv_column]
    assert [(row["n_kv_head"], row["kind"]) for row in rows] == [
        ("6", "MHA"),
        ("3", "GQA"),
        ("2", "GQA"),
        ("1", "MQA"),
    ]
    hd = D // H
    for row in rows:
        G = int(row["n_kv_head"])
        attn = 2 * D * D + 2 * D * G * hd  # c_q and c_proj, then c_k and c_v over G heads
        # wte, wpe, blocks (2 LayerNorms), ln_f
        params = V * D + T * D + L * (2 * D + attn + 2 * D * 4 * D) + D
        kv = 2 * L * 1 * G * T * hd * nbytes  # K and V, every layer, one sequence of T positions
        assert int(row["attention params/layer"].replace(",", "")) == attn
        assert float(row["params (M)"]) == round(params / 1e6, 2)
        assert float(row[kv_column]) == round(kv / 2**20, 2)


def test_the_costs_table_names_a_model_without_attention_so() -> None:
    """An all-recurrent variant (mha-dd: no layer attends) is 'none' in the kind column, with no
    K/V heads, not the MHA that its name's grammar starts from."""
    r = run(["compare.py", "--mode=costs", "--n_layer=2", "--variants=[mha,mha-dd,mha-dl]"])
    rows = [line.split(" | ")[:2] for line in r.stdout.splitlines() if line.startswith("| ")]
    assert ["| -", "none, Gated DeltaNet in DD"] in rows
    assert ["| 6", "MHA, Gated DeltaNet in DL"] in rows  # n_head=6, the default


def trained_run(
    folder: Path, dataset: Path, iters: int, data_meta: dict | None = None, **schedule: object
) -> bytes:
    """A run's checkpoint as a sweep leaves it at iteration iters, trained with SWEEP's settings
    but for schedule (a finished one: iters = max_iters), on the dataset's meta but for
    data_meta's keys; its bytes."""
    train_args = [a for a in SWEEP if not a.startswith(("--decode", "--speed"))]
    cfg = parse_config(TrainConfig, [f"--dataset={dataset}", *train_args])
    cfg = dataclasses.replace(cfg, out_dir=str(folder), **schedule)
    folder.mkdir(parents=True)
    (folder.parent / "compare.json").write_text('{"kind": "a comparison"}')  # the sweep's mark
    meta = load_meta(dataset)
    save_checkpoint(
        folder / "ckpt.pt",
        GPT(cfg.model_config(meta["vocab_size"])),  # the model the sweep trains there
        iter_num=iters,
        config=dataclasses.asdict(cfg),
        data_meta=meta | (data_meta or {}),
    )
    return (folder / "ckpt.pt").read_bytes()


@pytest.mark.parametrize(
    ("flags", "was", "now"),
    [
        (["--max_iters=60"], "max_iters=30", "max_iters=60"),  # trained on: its lr would rise again
        (["--max_iters=20"], "max_iters=30", "max_iters=20"),  # its final model past the budget
        (
            ["--warmup_iters=10"],
            "warmup_iters=5",
            "warmup_iters=10",
        ),  # the same budget, not schedule
        (["--lr_decay_iters=30", "--max_iters=30"], "lr_decay_iters=5000", "lr_decay_iters=30"),
    ],
)
def test_a_sweep_over_runs_trained_at_another_budget_is_refused_before_any_training(
    pycode_small: Path, tmp_path: Path, flags: list[str], was: str, now: str
) -> None:
    out = tmp_path / "cmp"
    before = trained_run(out / "mha-s1337", pycode_small, 30)
    r = cli(
        [
            "compare.py",
            f"--dataset={pycode_small}",
            f"--out_dir={out}",
            *SWEEP,
            "--kv_heads=[4,1]",
            *flags,
        ]
    )
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith(
        f"error: mha-s1337 has a checkpoint of another budget (mha-s1337: "
        f"{was}; this sweep: {now}): resumed, a run would change its "
        f"learning-rate schedule midway"
    )
    assert "use another out_dir, or --extend=True to train such runs on to this budget" in r.stderr
    assert "$ python train.py" not in r.stdout
    assert (out / "mha-s1337" / "ckpt.pt").read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == ["compare.json", "mha-s1337"]


@pytest.mark.parametrize(
    ("trained", "says"),
    [
        (
            {"batch_size": 4},
            "mha-s1337 was trained with batch_size=4, and this sweep asks batch_size=8",
        ),
        (
            {"eval_iters": 2},
            "mha-s1337 was trained with eval_iters=2, and this sweep asks eval_iters=4",
        ),
        ({"bias": True}, "mha-s1337 was trained with bias=True, and this sweep asks bias=False"),
        ({"log_interval": 1, "keep_last": 2}, None),  # where it logs and keeps: still this run
        # its dataset prepared again since, with as many tokens of the same characters
        ({"data_meta": {"train_tokens": 1}}, "mha-s1337 was trained on dataset "),
    ],
)
def test_a_sweep_reuses_a_run_only_as_it_would_train_it(
    pycode_small: Path, tmp_path: Path, trained: dict, says: str | None
) -> None:
    """A run trained before (its checkpoint) with other training keys or another model than the
    sweep would give it is one line before any work, not resumed or counted finished beside the
    others; one that differs only in where it logs and keeps its files is the sweep's run."""
    out = tmp_path / "cmp"
    meta = trained.pop("data_meta", {})
    before = trained_run(out / "mha-s1337", pycode_small, 30, meta, **trained)
    args = ["compare.py", f"--dataset={pycode_small}", f"--out_dir={out}", *SWEEP, "--kv_heads=[4]"]
    r = cli([*args, "--mode=plan"])
    if says is None:
        assert r.returncode == 0 and "1 runs, 1 to run" in r.stdout, r.stderr
        return
    assert r.returncode == 2 and r.stderr.startswith(f"error: {says}"), r.stderr
    assert len(r.stderr.splitlines()) == 1
    assert (out / "mha-s1337" / "ckpt.pt").read_bytes() == before


def test_extend_trains_runs_on_but_never_shortens_one_or_keeps_a_stale_conversion(
    pycode_small: Path, tmp_path: Path
) -> None:
    """--extend=True plans to resume a run trained for fewer iterations (nothing refused), and
    refuses a run trained past max_iters and conversions made of a model it would train on."""
    import compare

    out = tmp_path / "cmp"
    trained_run(out / "mha-s1337", pycode_small, 30)
    train_args = [a for a in SWEEP if not a.startswith(("--decode", "--speed"))]

    def check(*flags: str) -> None:
        argv = [f"--dataset={pycode_small}", f"--out_dir={out}", *train_args, *flags]
        cfg, base = compare.parse(argv)
        compare.check_runs(cfg, base, sweep.plan(cfg, base, 95, out))

    check("--kv_heads=[4,1]", "--max_iters=60", "--extend=True")
    shorter = (
        "extend=True trains runs on, and mha-s1337 is at iteration 30, past max_iters=20: "
        "use another out_dir for a shorter budget"
    )
    with pytest.raises(UserError, match=shorter):
        check("--kv_heads=[4,1]", "--max_iters=20", "--extend=True")
    converted = out / "mha-to-mqa-mean-u0-s1337"
    converted.mkdir()
    (converted / "log.jsonl").write_text("")
    conversion = ["--kv_heads=[4,1]", "--convert=True", "--uptrain_fractions=[0]"]
    check(*conversion)  # the same budget: nothing to refuse
    stale = (
        "extend=True trains on the models that mha-to-mqa-mean-u0-s1337 converted at their "
        "old budget: delete those folders"
    )
    with pytest.raises(UserError, match=stale):
        check(*conversion, "--max_iters=60", "--extend=True")
