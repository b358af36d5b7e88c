import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import (
    ROOT,
    SEED,
    TINY_TRAIN,
    one_thread,
    read_log,
    run,
    sigterm_rank_1,
)
from model import GPT, GPTConfig
from smallgpt.checkpoint import load_checkpoint

pytestmark = pytest.mark.slow


def test_two_gloo_processes_match_one_process_with_twice_the_accumulation(
    pycode_small: Path, tmp_path: Path
) -> None:
    common = [
        f"--dataset={pycode_small}",
        *TINY_TRAIN,
        "--max_iters=20",
        "--eval_interval=20",
        "--always_save_checkpoint=True",
        "--peak_flops=1e12",
        f"--seed={SEED}",
    ]
    r = run(
        [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "train.py",
            f"--out_dir={tmp_path / 'ddp'}",
            "--gradient_accumulation_steps=4",
            *common,
        ]
    )
    with one_thread():  # in this process, on 1 thread as each rank
        run(
            [
                "train.py",
                f"--out_dir={tmp_path / 'single'}",
                "--gradient_accumulation_steps=4",
                *common,
            ]
        )
    ddp, single = read_log(tmp_path / "ddp"), read_log(tmp_path / "single")
    ddp_losses = [x["loss"] for x in ddp if x["event"] == "train"]
    single_losses = [x["loss"] for x in single if x["event"] == "train"]
    assert len(ddp_losses) == 2
    assert ddp_losses == pytest.approx(single_losses, rel=1e-5)
    assert [x["val_loss"] for x in ddp if x["event"] == "eval"] == pytest.approx(
        [x["val_loss"] for x in single if x["event"] == "eval"], rel=1e-5
    )
    a, b = (load_checkpoint(tmp_path / name / "ckpt.pt")["model"] for name in ("ddp", "single"))
    assert a.keys() == b.keys() and not any(k.startswith("module.") for k in a)
    # Same data, same order of updates; only float summation order differs (gloo all-reduce, 1 vs 2
    # threads). AdamW divides each gradient by its running RMS, so weights whose gradients are near
    # zero can move apart by up to ~1e-5 of their lr * steps = 0.06 of travel: bound the largest
    # difference at 1e-4 and the mean at 1e-6.
    diffs = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
    assert diffs.max() < 1e-4 and diffs.mean() < 1e-6, (diffs.max(), diffs.mean())
    # only rank 0 logs and writes: each line once, and nothing but its files in out_dir
    assert r.stdout.count("iter 20: loss") == 1 and r.stdout.count("step 20:") == 1
    assert sorted(p.name for p in (tmp_path / "ddp").iterdir()) == [
        ".lock",
        "ckpt.pt",
        "config.json",
        "log.jsonl",
    ]
    assert ddp[0]["event"] == "config" and sum(x["event"] == "config" for x in ddp) == 1
    # MFU is each process's FLOP/s over its device's peak: the tokens of both processes count
    # against 2 peaks
    per_token = GPT(GPTConfig(**ddp[0]["model_config"])).flops_per_token(
        ddp[0]["config"]["block_size"]
    )
    for x in ddp[1:]:
        if x["event"] == "train":
            assert x["mfu"] == pytest.approx(per_token * x["tokens_per_s"] / 2e12, rel=1e-6)


def test_accumulation_not_divisible_by_world_size_is_one_clear_error(
    pycode_small: Path, tmp_path: Path
) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "train.py",
            f"--dataset={pycode_small}",
            f"--out_dir={tmp_path}",
            *TINY_TRAIN,
            "--gradient_accumulation_steps=3",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    # a worker prints its one line and exits 2 (torchrun's report gives each worker's status);
    # torchrun stops the other with SIGTERM (-15) if it is still running, and exits 1 itself (its
    # ChildFailedError)
    line = (
        "error: gradient_accumulation_steps=3 is not divisible by the 2 processes "
        "(it is the total over them), e.g. 4"
    )
    errors = [x for x in r.stderr.splitlines() if "error:" in x]
    assert errors and len(set(errors)) == len(errors) <= 2, r.stderr[-3000:]
    assert set(errors) <= {f"[rank {i}] {line}" for i in (0, 1)}, errors
    statuses = re.findall(r"exitcode\s*:\s*(-?\d+)", r.stderr)
    assert "2" in statuses and set(statuses) <= {"2", "-15"}, r.stderr[-3000:]
    assert r.returncode == 1
    assert (
        'train.py", line' not in r.stderr
    )  # no traceback from our code (torchrun's launcher adds its own report)


# test_each_rank_resumes_its_own_dropout_generators is test_reliability's
# test_torchrun_restarts_a_killed_worker_and_resumes_exactly[ddp] now: its restart resumes 2 ranks
# with dropout from a checkpoint, exactly (without 3 launches of its own)


@pytest.mark.skipif(
    not Path("/proc/self/stat").exists(), reason="finds torchrun's workers through /proc (Linux)"
)
def test_sigterm_to_one_rank_stops_both_and_rank_0_saves_once(
    pycode_small: Path, tmp_path: Path
) -> None:
    """SIGTERM to rank 1 only (a pre-emption notice reaching one worker): the ranks agree at the
    next log step, rank 0 writes one checkpoint at the iteration both stopped at, torchrun exits 0,
    and the run resumes from it."""
    stdout, stderr, code = sigterm_rank_1(pycode_small, tmp_path)
    assert code == 0, stderr[-3000:]
    assert (
        stdout.count("stopping on a signal to another rank at iteration") == 1
        and "Traceback" not in stderr
    )
    assert stdout.count("saved checkpoint to") == 1
    ckpt = load_checkpoint(tmp_path / "ckpt.pt")
    logged = [r["iter"] for r in read_log(tmp_path) if r["event"] == "train"]
    assert 1 <= ckpt["iter_num"] == logged[-1] < 100000
    run(
        [
            "train.py",
            f"--dataset={pycode_small}",
            f"--out_dir={tmp_path}",
            *TINY_TRAIN,
            "--log_interval=1",
            "--init_from=resume",
            f"--max_iters={ckpt['iter_num'] + 2}",
        ]
    )
    assert [r["iter"] for r in read_log(tmp_path) if r["event"] == "train"][-2:] == [
        ckpt["iter_num"] + 1,
        ckpt["iter_num"] + 2,
    ]
