"""Checkpoints that survive kill -9, divergence handling, restarts under torchrun, up-front
checks."""

import contextlib
import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, TINY_TRAIN, cli, log_so_far, read_log, run, worker_ranks
from model import GPT, GPTConfig
from smallgpt.checkpoint import check_out_dir, load_checkpoint
from smallgpt.data import Batches
from smallgpt.errors import UserError
from smallgpt.runlog import read_run
from smallgpt.runtime import Dist
from train import train_step


def train_args(data: Path, out: Path, *extra: str) -> list[str]:
    return ["train.py", f"--dataset={data}", f"--out_dir={out}", *TINY_TRAIN, *extra]


def train_losses(out: Path) -> dict[int, float]:
    """The logged loss of every iteration (a repeated iteration, after a restart, keeps its last
    record)."""
    return {r["iter"]: r["loss"] for r in read_log(out) if r["event"] == "train"}


def finite(ckpt: dict) -> bool:
    return all(bool(t.isfinite().all()) for t in ckpt["model"].values())


def test_divergence_stops_the_run_and_keeps_the_last_good_checkpoint(
    pycode_small: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    run(
        train_args(
            pycode_small, out, "--max_iters=4", "--eval_interval=2", "--always_save_checkpoint=True"
        )
    )
    good = (out / "ckpt.pt").read_bytes()
    r = cli(
        [
            *train_args(
                pycode_small,
                out,
                "--init_from=resume",
                "--max_iters=40",
                "--eval_interval=2",
                "--always_save_checkpoint=True",
                "--log_interval=1",
                "--learning_rate=1e30",
                "--decay_lr=False",
            )
        ]
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1, (
        r.stderr
    )
    assert "training diverged; the last good checkpoint (iteration 4) is kept" in r.stderr
    assert "--nonfinite=skip" in r.stderr
    assert (out / "ckpt.pt").read_bytes() == good and finite(load_checkpoint(out / "ckpt.pt"))


def test_skip_mode_drops_a_nonfinite_step_and_leaves_weights_and_optimizer_untouched(
    pycode_small: Path,
) -> None:
    batches = Batches(pycode_small, block_size=32, batch_size=4, seed=1337, device="cpu")
    model = GPT(
        GPTConfig(
            block_size=32, vocab_size=batches.meta["vocab_size"], n_layer=2, n_head=4, n_embd=32
        )
    )
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu")
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    d = Dist(0, 0, 1, "cpu", True)

    def step(it: int, skip: bool = True) -> bool:
        return train_step(
            model,
            model,
            opt,
            scaler,
            batches,
            it,
            d,
            1,
            torch.autocast("cpu", enabled=False),
            1.0,
            skip,
        )[1]

    assert step(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    adam_steps = [s["step"].item() for s in opt.state.values()]
    # a fault in one step (here: NaN activations in the first block, as a bad kernel or bit flip
    # would give)
    hook = model.transformer.h[0].register_forward_hook(lambda m, i, o: o * float("nan"))
    assert not step(1)
    hook.remove()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert [s["step"].item() for s in opt.state.values()] == adam_steps
    assert step(2)
    assert not torch.equal(before["lm_head.weight"], model.lm_head.weight) and finite(
        {"model": model.state_dict()}
    )


def test_skip_mode_counts_skipped_steps_in_the_log(pycode_small: Path, tmp_path: Path) -> None:
    """lr=1e30 blows the weights up after one step: every later step has a NaN gradient and is
    skipped; the evaluation at the end still sees the broken model and stops the run without writing
    a checkpoint."""
    out = tmp_path / "out"
    r = cli(
        [
            *train_args(
                pycode_small,
                out,
                "--max_iters=6",
                "--eval_interval=6",
                "--log_interval=2",
                "--learning_rate=1e30",
                "--decay_lr=False",
                "--nonfinite=skip",
            )
        ]
    )
    assert r.returncode == 2 and "the val loss is nan at iteration 6" in r.stderr
    assert "no checkpoint was written yet" in r.stderr and not (out / "ckpt.pt").exists()
    assert "--nonfinite=skip" not in r.stderr  # (it is set: not advised again)
    skipped = [x["skipped"] for x in read_log(out) if x["event"] == "train"]
    assert skipped[-1] >= 4 and "non-finite steps skipped" in r.stdout


def test_keep_last_keeps_the_k_newest_checkpoints(pycode_small: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    run(
        train_args(
            pycode_small,
            out,
            "--max_iters=8",
            "--eval_interval=2",
            "--always_save_checkpoint=True",
            "--keep_last=2",
        )
    )
    assert sorted(p.name for p in out.glob("ckpt*.pt")) == [
        "ckpt-0000006.pt",
        "ckpt-0000008.pt",
        "ckpt.pt",
    ]
    assert load_checkpoint(out / "ckpt-0000006.pt")["iter_num"] == 6
    assert (out / "ckpt-0000008.pt").read_bytes() == (out / "ckpt.pt").read_bytes()


def test_keep_last_copies_where_the_file_system_has_no_hard_links(
    pycode_small: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where link(2) fails (EPERM: a file system without hard links), the kept checkpoints are
    copies."""

    def no_links(src: object, dst: object, **kwargs: object) -> None:
        raise OSError(errno.EPERM, "Operation not permitted", str(dst))

    monkeypatch.setattr(os, "link", no_links)  # the train.py run below runs in this process
    out = tmp_path / "out"
    run(
        train_args(
            pycode_small,
            out,
            "--max_iters=8",
            "--eval_interval=2",
            "--always_save_checkpoint=True",
            "--keep_last=2",
        )
    )
    assert sorted(p.name for p in out.glob("ckpt*.pt")) == [
        "ckpt-0000006.pt",
        "ckpt-0000008.pt",
        "ckpt.pt",
    ]
    assert all(p.stat().st_nlink == 1 for p in out.glob("ckpt*.pt"))  # copies, no links
    assert (out / "ckpt-0000008.pt").read_bytes() == (out / "ckpt.pt").read_bytes()
    assert load_checkpoint(out / "ckpt-0000006.pt")["iter_num"] == 6


def test_weights_gone_non_finite_are_never_saved(pycode_small: Path, tmp_path: Path) -> None:
    """AdamW's decay (each matrix times 1 - lr * weight_decay = 1 - 1e40) makes the weights infinite
    at the first step; with no log step or evaluation to see the loss (both far off), SIGTERM's save
    is what finds them: one line, exit 2, and no checkpoint written."""
    out = tmp_path / "out"
    p = subprocess.Popen(
        [
            sys.executable,
            *train_args(
                pycode_small,
                out,
                "--max_iters=100000",
                "--eval_interval=100000",
                "--log_interval=100000",
                "--learning_rate=1e30",
                "--weight_decay=1e10",
                "--decay_lr=False",
            ),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not any(r["event"] == "eval" for r in log_so_far(out)):
            time.sleep(
                0.1
            )  # the evaluation at iteration 0: the run's loop (and its signal handler) has started
        p.send_signal(signal.SIGTERM)
        _, stderr = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 2 and "Traceback" not in stderr and len(stderr.splitlines()) == 1, stderr
    assert (
        stderr.startswith("error: a weight is nan at iteration ")
        and "no checkpoint was written yet" in stderr
    )
    assert not list(out.glob("ckpt*"))
    # logged, for a learning-rate sweep to count the run as diverged (compare.py --lrs)
    last = log_so_far(out)[-1]
    assert (last["event"], last["what"], last["value"]) == ("diverged", "a weight", "nan")


def test_smallgpt_debug_shows_a_user_errors_traceback(tmp_path: Path) -> None:
    """A user error is one `error:` line and exit 2; with SMALLGPT_DEBUG=1 it is raised: its
    traceback, exit 1."""
    args = train_args(tmp_path / "none", tmp_path / "out")
    plain, debug = cli(args), cli(args, env={"SMALLGPT_DEBUG": "1"})
    assert plain.returncode == 2 and len(plain.stderr.splitlines()) == 1
    assert plain.stderr.startswith(f"error: no dataset at {tmp_path / 'none'} (missing meta.json)")
    assert debug.returncode == 1 and debug.stderr.startswith("Traceback (most recent call last):")
    assert debug.stderr.splitlines()[-1].startswith(
        f"smallgpt.errors.UserError: no dataset at {tmp_path / 'none'}"
    )


def test_kill_9_during_a_save_leaves_the_previous_checkpoint_loadable(
    pycode_small: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"  # a ~90 MB checkpoint, saved after every step: the write takes a while
    p = subprocess.Popen(
        [
            sys.executable,
            *train_args(
                pycode_small,
                out,
                "--n_layer=4",
                "--n_embd=384",
                "--batch_size=2",
                "--eval_iters=1",
                "--eval_interval=1",
                "--always_save_checkpoint=True",
                "--max_iters=100000",
            ),
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ckpt = out / "ckpt.pt"
    temps = []
    try:
        deadline = time.time() + 120
        while not ckpt.exists() and time.time() < deadline:  # a first checkpoint...
            time.sleep(0.01)
        while (
            not temps and time.time() < deadline
        ):  # ...then kill the process while it writes the next
            temps = list(out.glob(".ckpt.pt.smallgpt-*"))
            time.sleep(0.0005)
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        p.kill()
    assert temps and temps[0].exists(), "the kill did not land during a save"
    (out / ".ckpt.pt.mine").write_text("a user's file beside the temp: never removed")
    state = load_checkpoint(ckpt)
    assert state["iter_num"] >= 1 and finite(state)
    r = run(
        train_args(
            pycode_small,
            out,
            "--n_layer=4",
            "--n_embd=384",
            "--batch_size=2",
            "--eval_iters=1",
            "--init_from=resume",
            f"--max_iters={state['iter_num'] + 1}",
            "--eval_interval=1000",
        )
    )
    assert f"iter {state['iter_num'] + 1}" in r.stdout
    assert (
        not temps[0].exists() and (out / ".ckpt.pt.mine").is_file()
    )  # the stale temp removed, under the lock


def test_out_dir_without_room_for_a_checkpoint_fails_up_front(tmp_path: Path) -> None:
    check_out_dir(tmp_path / "ok", 1)
    with pytest.raises(
        UserError,
        match=r"MiB free, but the run's checkpoints need about .* MiB \(.* MiB each, "
        r"keep_last=0\): free some space",
    ):
        check_out_dir(tmp_path / "ok", 2**62)


def test_wandb_online_without_network_falls_back_to_offline(
    pycode_small: Path, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "WANDB_MODE"} | {
        "WANDB_BASE_URL": "http://127.0.0.1:9",
        "WANDB_API_KEY": "x" * 40,
    }  # port 9 (discard): nothing listens
    r = subprocess.run(
        [
            sys.executable,
            *train_args(pycode_small, tmp_path / "out", "--max_iters=2", "--wandb_log=True"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    # the run went offline (no online attempt, which would wait ~100 s and end in wandb's own error)
    assert "wandb: cannot reach http://127.0.0.1:9" in r.stdout and "logging offline" in r.stdout
    assert list((tmp_path / "out" / "wandb").glob("offline-run-*"))


def last_iter(out: Path) -> int:
    """The last iteration logged so far (0 before any)."""
    return max((r["iter"] for r in log_so_far(out) if r["event"] == "train"), default=0)


@pytest.mark.slow
@pytest.mark.skipif(
    not Path("/proc/self/stat").exists(), reason="finds torchrun's workers through /proc (Linux)"
)
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_torchrun_restarts_a_killed_worker_and_resumes_exactly(
    pycode_small: Path, tmp_path: Path, parallel: str
) -> None:
    """A worker killed with SIGKILL mid-run: torchrun --max-restarts=1 starts both workers again,
    init_from=auto resumes from the last checkpoint (a sharded one under FSDP), and every
    iteration's loss, and the final weights, equal an uninterrupted 2-process run's.

    Also test_ddp's test_each_rank_resumes_its_own_dropout_generators (merged here, [ddp]; [fsdp]
    checks the same): each rank draws dropout masks of its own and the checkpoint keeps every
    rank's generator states, so 2 processes resumed with dropout give the uninterrupted run's losses
    and weights exactly (rank 1 given rank 0's states on resume would draw rank 0's masks)."""
    common = [
        "--init_from=auto",
        "--always_save_checkpoint=True",
        "--eval_interval=10",
        "--log_interval=1",
        "--max_iters=40",
        "--gradient_accumulation_steps=2",
        "--dropout=0.1",
        f"--parallel={parallel}",
    ]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    run([*launch[1:], *train_args(pycode_small, tmp_path / "once", *common)])
    out = tmp_path / "killed"
    env = os.environ | {
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"
    }  # see docs/reliability.md: Restarts
    p = subprocess.Popen(
        [*launch, "--max-restarts=1", *train_args(pycode_small, out, *common)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 120
        while (
            time.time() < deadline and last_iter(out) < 15
        ):  # past a checkpoint, 25 iterations from the end
            time.sleep(0.05)
        workers = worker_ranks(p.pid)
        assert sorted(workers) == [0, 1], workers
        os.kill(workers[1], signal.SIGKILL)
        output, _ = p.communicate(timeout=240)
    finally:  # torchrun and its workers (each in a session of its own), whatever happened
        for pid in [p.pid, *worker_ranks(p.pid).values()]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    (tmp_path / "torchrun.txt").write_text(output)
    assert p.returncode == 0, output[-3000:]
    log = read_log(out)
    starts = [i for i, x in enumerate(log) if x["event"] == "config"]
    assert len(starts) == 2  # the first attempt, and the restart
    resumed_at = next(x["iter"] for x in log[starts[1] :] if x["event"] == "train") - 1
    assert 10 <= resumed_at < 40 and resumed_at % 10 == 0
    assert train_losses(out) == train_losses(tmp_path / "once")
    # the log reader keeps one record per iteration: the restart's, not those logged past its
    # checkpoint
    killed, once = read_run(out), read_run(tmp_path / "once")
    assert [x["iter"] for x in killed["trains"]] == list(range(1, 41))
    assert [x["loss"] for x in killed["trains"]] == [x["loss"] for x in once["trains"]]
    assert [x["iter"] for x in killed["evals"]] == list(range(0, 41, 10))
    assert [x["val_loss"] for x in killed["evals"]] == pytest.approx(
        [x["val_loss"] for x in once["evals"]]
    )
    assert (
        killed["trains"][-1]["wall_s"] > killed["trains"][-1]["elapsed_s"]
    )  # the first attempt's time counts
    # every rank's dropout generator states, apart; the weights exactly the uninterrupted run's
    ckpt = load_checkpoint(out / "ckpt.pt")
    states = ckpt["rng"]
    assert len(states) == 2 and not torch.equal(states[0]["torch"], states[1]["torch"])
    a, b = ckpt["model"], load_checkpoint(tmp_path / "once" / "ckpt.pt")["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_log_line_cut_short_by_a_kill_stays_apart_from_the_resume(tmp_path: Path) -> None:
    """A kill mid-write leaves log.jsonl's last line cut short: the resume's RunLog starts on a new
    line, and read_run skips the cut line, keeps one record per iteration and adds each attempt's
    time once (one attempt was killed before logging anything)."""
    from smallgpt.runlog import RunLog
    from train import TrainConfig

    def record(**r: object) -> str:
        return json.dumps(r | {"time": 0.0}) + "\n"

    cfg, mcfg = TrainConfig(out_dir=str(tmp_path)), GPTConfig()
    first = {
        "event": "config",
        "config": dataclasses.asdict(cfg),
        "model_config": dataclasses.asdict(mcfg),
    }
    (tmp_path / "log.jsonl").write_text(
        record(**first, start_iter=0)
        + record(event="train", iter=1, elapsed_s=1.0)
        + record(event="train", iter=2, elapsed_s=2.0)
        + '{"event": "train", "it'
    )
    RunLog(cfg, mcfg, start_iter=1).close()  # an attempt killed before its first record
    log = RunLog(cfg, mcfg, start_iter=1)
    log.write(event="train", iter=2, elapsed_s=0.5)
    log.close()
    run = read_run(tmp_path)
    assert [(r["iter"], r["wall_s"]) for r in run["trains"]] == [(1, 1.0), (2, 2.5)]
