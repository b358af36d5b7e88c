import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoint import load_checkpoint
from conftest import ROOT, SEED, TINY_TRAIN, read_log, run
from model import GPT, GPTConfig

pytestmark = pytest.mark.slow


def test_two_gloo_processes_match_one_process_with_twice_the_accumulation(pycode_small: Path, tmp_path: Path) -> None:
    common = [f"--dataset={pycode_small}", *TINY_TRAIN, "--max_iters=20", "--eval_interval=20",
              "--always_save_checkpoint=True", "--peak_flops=1e12", f"--seed={SEED}"]
    r = run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
             f"--out_dir={tmp_path / 'ddp'}", "--gradient_accumulation_steps=4", *common])
    run(["train.py", f"--out_dir={tmp_path / 'single'}", "--gradient_accumulation_steps=4", *common],
        env={"OMP_NUM_THREADS": "1"}, fresh=True)
    ddp, single = read_log(tmp_path / "ddp"), read_log(tmp_path / "single")
    ddp_losses = [x["loss"] for x in ddp if x["event"] == "train"]
    single_losses = [x["loss"] for x in single if x["event"] == "train"]
    assert len(ddp_losses) == 2
    assert ddp_losses == pytest.approx(single_losses, rel=1e-5)
    assert [x["val_loss"] for x in ddp if x["event"] == "eval"] == pytest.approx(
        [x["val_loss"] for x in single if x["event"] == "eval"], rel=1e-5)
    a, b = (load_checkpoint(tmp_path / name / "ckpt.pt")["model"] for name in ("ddp", "single"))
    assert a.keys() == b.keys() and not any(k.startswith("module.") for k in a)
    # Same data, same order of updates; only float summation order differs (gloo all-reduce, 1 vs 2 threads).
    # AdamW divides each gradient by its running RMS, so weights whose gradients are near zero can move apart by
    # up to ~1e-5 of their lr * steps = 0.06 of travel: bound the largest difference at 1e-4 and the mean at 1e-6.
    diffs = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
    assert diffs.max() < 1e-4 and diffs.mean() < 1e-6, (diffs.max(), diffs.mean())
    # only rank 0 logs and writes: each line once, and nothing but its files in out_dir
    assert r.stdout.count("iter 20: loss") == 1 and r.stdout.count("step 20:") == 1
    assert sorted(p.name for p in (tmp_path / "ddp").iterdir()) == [".lock", "ckpt.pt", "config.json", "log.jsonl"]
    assert ddp[0]["event"] == "config" and sum(x["event"] == "config" for x in ddp) == 1
    # MFU is each process's FLOP/s over its device's peak: the tokens of both processes count against 2 peaks
    per_token = GPT(GPTConfig(**ddp[0]["model_config"])).flops_per_token(ddp[0]["config"]["block_size"])
    for x in ddp[1:]:
        if x["event"] == "train":
            assert x["mfu"] == pytest.approx(per_token * x["tokens_per_s"] / 2e12, rel=1e-6)


def test_accumulation_not_divisible_by_world_size_is_one_clear_error(pycode_small: Path, tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "train.py", f"--dataset={pycode_small}", f"--out_dir={tmp_path}", *TINY_TRAIN,
                        "--gradient_accumulation_steps=3"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "error: gradient_accumulation_steps=3 is not divisible by the 2 processes" in r.stderr
    assert "train.py\", line" not in r.stderr  # no traceback from our code (torchrun's launcher adds its own report)
