"""FSDP2 under torchrun with 2 gloo processes on CPU: agreement with one process, sharded
checkpoints read at another process count, the gathered ckpt.pt for sample.py, the sharded memory
accounting."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, SEED, TINY_TRAIN, cli, read_log, run, worker_ranks
from model import GPT, GPTConfig
from smallgpt.checkpoint import load_checkpoint
from smallgpt.generation import generate

pytestmark = pytest.mark.slow
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def train(data: Path, out: Path, *extra: str, procs: int = 1, fresh: bool = True) -> str:
    """train.py's stdout, under torchrun with 2 processes or in a process of its own (1 thread: as
    each rank), or for one process with fresh=False in this one (for a run whose numbers are
    compared with no other run's: no fresh interpreter's 2-3 s of imports)."""
    args = [
        "train.py",
        f"--dataset={data}",
        f"--out_dir={out}",
        *TINY_TRAIN,
        "--gradient_accumulation_steps=2",
        "--eval_interval=10",
        "--always_save_checkpoint=True",
        "--log_interval=1",
        f"--seed={SEED}",
        *extra,
    ]
    return run(
        [*TORCHRUN, *args] if procs == 2 else args, env={"OMP_NUM_THREADS": "1"}, fresh=fresh
    ).stdout


def losses(out: Path) -> dict[int, float]:
    return {r["iter"]: r["loss"] for r in read_log(out) if r["event"] == "train"}


def weight_diffs(a: Path, b: Path) -> torch.Tensor:
    sa, sb = (load_checkpoint(p / "ckpt.pt")["model"] for p in (a, b))
    assert sa.keys() == sb.keys()
    return torch.cat([(sa[k] - sb[k]).abs().flatten() for k in sa])


@pytest.fixture(scope="module")
def plain(pycode_small: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """20 iterations in one process without FSDP: the run the others must reproduce."""
    out = tmp_path_factory.mktemp("plain")
    train(pycode_small, out, "--max_iters=20")
    return out


def test_fsdp_matches_one_process(pycode_small: Path, plain: Path, tmp_path: Path) -> None:
    stdout = train(pycode_small, tmp_path, "--max_iters=20", "--parallel=fsdp", procs=2)
    # The same initial weights (drawn parameter by parameter, each rank keeping its shard) and the
    # same 2 x 8 sequences a step; only the summation order of the gradient's reduce-scatter differs
    # from one process's accumulation, a float rounding (~1e-7 relative) that AdamW's normalised
    # steps carry over 20 steps: losses to 1e-5 relative, weights (std 0.02, lr 3e-3) to 1e-4 at
    # most and 1e-6 on average, as for DDP (test_ddp).
    assert list(losses(tmp_path)) == list(range(1, 21))
    assert list(losses(tmp_path).values()) == pytest.approx(list(losses(plain).values()), rel=1e-5)
    diffs = weight_diffs(tmp_path, plain)
    assert diffs.max() < 1e-4 and diffs.mean() < 1e-6, (diffs.max(), diffs.mean())
    # rank 0 alone prints and writes ckpt.pt; both ranks wrote their shards into the one folder
    # ckpt.pt names
    assert stdout.count("step 20:") == 1 and stdout.count("saved checkpoint") == 2
    ckpt = load_checkpoint(tmp_path / "ckpt.pt")
    assert ckpt["sharded"] == "sharded-0000020" and "optimizer" not in ckpt
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".lock",
        "ckpt.pt",
        "config.json",
        "log.jsonl",
        "sharded-0000020",
    ]
    assert len(list((tmp_path / "sharded-0000020").glob("*.distcp"))) == 2


@pytest.mark.parametrize(
    "first, then",
    [((2, "fsdp"), (1, "ddp")), ((1, "fsdp"), (2, "fsdp")), ((1, "ddp"), (2, "fsdp"))],
)
def test_sharded_checkpoint_resumes_at_another_process_count(
    pycode_small: Path, plain: Path, tmp_path: Path, first: tuple, then: tuple
) -> None:
    """Written by 2 FSDP processes and resumed by one plain process, written by one FSDP process and
    resumed by 2, or written whole by one plain process and resumed by 2 under FSDP: the loss curve
    continues as the uninterrupted run's."""
    train(pycode_small, tmp_path, "--max_iters=10", f"--parallel={first[1]}", procs=first[0])
    train(
        pycode_small,
        tmp_path,
        "--max_iters=20",
        "--init_from=resume",
        f"--parallel={then[1]}",
        procs=then[0],
    )
    resumed, once = losses(tmp_path), losses(plain)
    assert list(resumed) == list(range(1, 21))
    # the sharded folders that no checkpoint names are gone (the FSDP run's, once a plain run has
    # saved)
    assert [p.name for p in tmp_path.glob("sharded-*")] == ["sharded-0000020"] * (then[1] == "fsdp")
    assert list(resumed.values()) == pytest.approx(list(once.values()), rel=1e-5)
    diffs = weight_diffs(tmp_path, plain)
    assert diffs.max() < 1e-4 and diffs.mean() < 1e-6, (diffs.max(), diffs.mean())


def test_the_gathered_checkpoint_samples_and_converts(pycode_small: Path, tmp_path: Path) -> None:
    train(
        pycode_small,
        tmp_path / "fsdp",
        "--max_iters=10",
        "--parallel=fsdp",
        "--pos_encoding=rope",
        procs=2,
    )
    r = run(
        [
            "sample.py",
            f"--out_dir={tmp_path / 'fsdp'}",
            "--num_samples=1",
            "--max_new_tokens=20",
            "--start=def ",
            "--temperature=0",
            "--device=cpu",
        ]
    )
    ckpt = load_checkpoint(tmp_path / "fsdp" / "ckpt.pt")
    model = GPT(GPTConfig(**ckpt["model_config"])).eval()
    model.load_state_dict(ckpt["model"])
    chars = ckpt["data_meta"]["chars"]
    start = torch.tensor([chars.index(c) for c in "def "])[None]
    expected = "".join(chars[i] for i in generate(model, start, 20, temperature=0.0)[0].tolist())
    assert expected in r.stdout
    run(["export.py", f"--out_dir={tmp_path / 'fsdp'}"])  # export reads the gathered ckpt.pt too
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "fsdp" / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(start).logits[:, -1:], model(start)[0], rtol=0, atol=1e-4)
    train(
        pycode_small,
        tmp_path / "mqa",
        "--max_iters=2",
        f"--init_from=convert:{tmp_path / 'fsdp'}",
        "--n_kv_head=1",
        "--pos_encoding=rope",
        "--parallel=fsdp",
        procs=2,
    )
    assert load_checkpoint(tmp_path / "mqa" / "ckpt.pt")["model_config"]["n_kv_head"] == 1


def gloo_threads() -> int:
    """How many of this process's threads belong to a gloo process group (its worker and transport
    threads)."""
    return sum(
        Path(t, "comm").read_text().startswith(("pt_gloo", "gloo"))
        for t in Path("/proc/self/task").iterdir()
    )


def test_an_fsdp_run_ends_its_gloo_threads_before_the_process_exits(
    pycode_small: Path, tmp_path: Path
) -> None:
    """DTensor's caches keep FSDP's device mesh and, through it, the process group alive past
    destroy_process_group: its gloo threads then ran into the interpreter's exit, where one that
    still released a collective's tensors aborted a rank now and then (SIGABRT, "terminate called
    without an active exception"). train.py ends them."""
    before = gloo_threads()
    run(
        [
            "train.py",
            f"--dataset={pycode_small}",
            f"--out_dir={tmp_path}",
            *TINY_TRAIN,
            "--max_iters=2",
            "--parallel=fsdp",
        ]
    )  # in this process: a group of its own
    assert (tmp_path / "ckpt.pt").is_file() and gloo_threads() == before


def test_sigterm_under_fsdp_saves_a_sharded_checkpoint_that_resumes(
    pycode_small: Path, tmp_path: Path
) -> None:
    args = [
        sys.executable,
        *TORCHRUN,
        "train.py",
        f"--dataset={pycode_small}",
        f"--out_dir={tmp_path}",
        *TINY_TRAIN,
        "--log_interval=1",
        "--max_iters=100000",
        "--eval_interval=100000",
        "--parallel=fsdp",
        "--gradient_accumulation_steps=2",
    ]
    p = subprocess.Popen(
        args,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
    )
    deadline = time.time() + 120
    while time.time() < deadline and not any(
        r["event"] == "train" for r in read_log_or_empty(tmp_path)
    ):
        time.sleep(0.2)
    os.kill(
        worker_ranks(p.pid)[1], signal.SIGTERM
    )  # one rank is told (pre-emption); both stop at a log step
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 0, stderr[-3000:]
    assert (
        stdout.count("stopping on a signal to another rank at iteration") == 1
        and "Traceback" not in stderr
    )
    ckpt = load_checkpoint(tmp_path / "ckpt.pt")
    assert (tmp_path / ckpt["sharded"]).is_dir() and ckpt["iter_num"] >= 1
    train(
        pycode_small,
        tmp_path,
        f"--max_iters={ckpt['iter_num'] + 2}",
        "--init_from=resume",
        "--parallel=fsdp",
        procs=2,
    )
    assert list(losses(tmp_path))[-2:] == [ckpt["iter_num"] + 1, ckpt["iter_num"] + 2]
    assert sorted(p.name for p in tmp_path.glob("sharded-*")) == [
        f"sharded-{ckpt['iter_num'] + 2:07d}"
    ]


def read_log_or_empty(out: Path) -> list[dict]:
    try:
        return read_log(out)
    except (FileNotFoundError, ValueError):  # not there yet, or a line half written
        return []


def test_per_rank_bytes_are_the_shards_of_fully_shard() -> None:
    """16 bytes a parameter (fp32 weight, gradient, two AdamW moments): whole under DDP; under FSDP
    rank 0 holds the first of world_size row chunks (torch.chunk, as FSDP2 shards dim 0) of each
    parameter."""
    from smallgpt import sharding

    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=36, block_size=10, vocab_size=37)
    model = GPT(cfg)
    params = sum(p.numel() for p in model.parameters())
    for world in (2, 4, 8):
        rows = sum(torch.chunk(p, world)[0].numel() for p in model.parameters())
        assert sharding.per_rank_bytes(cfg, world) == {
            "params": params,
            "ddp_bytes": 16 * params,
            "fsdp_bytes": 16 * rows,
        }


def test_keep_last_keeps_the_sharded_folders_its_checkpoints_name(
    pycode_small: Path, tmp_path: Path
) -> None:
    train(
        pycode_small,
        tmp_path,
        "--max_iters=8",
        "--eval_interval=2",
        "--keep_last=2",
        "--parallel=fsdp",
        fresh=False,
    )
    assert sorted(p.name for p in tmp_path.glob("*-*")) == [
        "ckpt-0000006.pt",
        "ckpt-0000008.pt",
        "sharded-0000006",
        "sharded-0000008",
    ]
    assert load_checkpoint(tmp_path / "ckpt-0000006.pt")["sharded"] == "sharded-0000006"


def test_a_missing_or_corrupt_sharded_checkpoint_is_one_line(
    pycode_small: Path, tmp_path: Path
) -> None:
    train(
        pycode_small, tmp_path, "--max_iters=2", "--eval_interval=2", "--parallel=fsdp", fresh=False
    )
    folder = tmp_path / "sharded-0000002"
    resume = [
        "train.py",
        f"--dataset={pycode_small}",
        f"--out_dir={tmp_path}",
        *TINY_TRAIN,
        "--max_iters=4",
        "--init_from=resume",
    ]
    next(folder.glob("*.distcp")).write_bytes(b"garbage")
    r = cli(resume)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.splitlines()[-1].startswith(
        f"error: the sharded checkpoint {folder} is corrupt"
    )
    for path in folder.iterdir():
        path.unlink()
    r = cli([*resume, "--parallel=fsdp"])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.splitlines()[-1] == (
        f"error: the sharded checkpoint {folder}, which {tmp_path / 'ckpt.pt'} "
        f"names, is missing or incomplete: restore it, or start a new run"
    )
