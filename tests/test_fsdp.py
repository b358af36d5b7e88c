"""FSDP2 under torchrun with 2 gloo processes on CPU: agreement with one process, sharded
checkpoints read at another process count, the gathered ckpt.pt for sample.py, the sharded memory
accounting.

Each torchrun launch costs seconds (three interpreters importing torch, a gloo group): the runs
several tests read are module fixtures that no test writes into (a test that goes on from one copies
it first), and the one-process runs are made in this process on one thread (conftest.one_thread)."""

import shutil
from pathlib import Path

import pytest
import torch

from conftest import (
    SEED,
    TINY_TRAIN,
    TORCHRUN,
    cli,
    one_thread,
    read_log,
    run,
    sigterm_rank_1,
)
from model import GPT, GPTConfig
from smallgpt.checkpoint import load_checkpoint
from smallgpt.generation import generate

pytestmark = pytest.mark.slow
# the tests that go on from the rope FSDP run (fsdp_rope) run in one pytest-xdist worker, which
# makes it once
FROM_FSDP_ROPE = pytest.mark.xdist_group("fsdp_rope")


def train(data: Path, out: Path, *extra: str, procs: int = 1) -> str:
    """train.py's stdout, under torchrun with 2 processes (1 thread each) or, for one process, in
    this one on 1 thread (as each rank: the numbers of a fresh OMP_NUM_THREADS=1 process, without
    its 2-3 s of imports)."""
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
    if procs == 2:
        return run([*TORCHRUN, *args], env={"OMP_NUM_THREADS": "1"}).stdout
    with one_thread():
        return run(args).stdout


def losses(out: Path) -> dict[int, float]:
    return {r["iter"]: r["loss"] for r in read_log(out) if r["event"] == "train"}


def weight_diffs(a: Path, b: Path) -> torch.Tensor:
    sa, sb = (load_checkpoint(p / "ckpt.pt")["model"] for p in (a, b))
    assert sa.keys() == sb.keys()
    return torch.cat([(sa[k] - sb[k]).abs().flatten() for k in sa])


@pytest.fixture(scope="module")
def plain(pycode_small: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """20 iterations in one process without FSDP: the run test_fsdp_matches_one_process's must
    reproduce."""
    out = tmp_path_factory.mktemp("plain")
    train(pycode_small, out, "--max_iters=20")
    return out


@pytest.fixture(scope="module")
def plain_rope(pycode_small: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """plain with rotary positions: the run the resumed ones must reproduce."""
    out = tmp_path_factory.mktemp("plain_rope")
    train(pycode_small, out, "--max_iters=20", "--pos_encoding=rope")
    return out


@pytest.fixture(scope="module")
def fsdp(pycode_small: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """20 iterations of 2 FSDP processes (its out_dir and stdout), compared with plain."""
    out = tmp_path_factory.mktemp("fsdp")
    return out, train(pycode_small, out, "--max_iters=20", "--parallel=fsdp", procs=2)


@pytest.fixture(scope="module")
def fsdp_rope(pycode_small: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """10 iterations of 2 FSDP processes with rotary positions (their tables are buffers, made on
    each rank after the meta device): the gathered ckpt.pt that sample.py, export.py and a
    conversion read, and the sharded checkpoint that one plain process resumes."""
    out = tmp_path_factory.mktemp("fsdp_rope")
    train(pycode_small, out, "--max_iters=10", "--parallel=fsdp", "--pos_encoding=rope", procs=2)
    return out


def test_fsdp_matches_one_process(plain: Path, fsdp: tuple[Path, str]) -> None:
    out, stdout = fsdp
    # The same initial weights (drawn parameter by parameter, each rank keeping its shard) and the
    # same 2 x 8 sequences a step; only the summation order of the gradient's reduce-scatter differs
    # from one process's accumulation, a float rounding (~1e-7 relative) that AdamW's normalised
    # steps carry over 20 steps: losses to 1e-5 relative, weights (std 0.02, lr 3e-3) to 1e-4 at
    # most and 1e-6 on average, as for DDP (test_ddp).
    assert list(losses(out)) == list(range(1, 21))
    assert list(losses(out).values()) == pytest.approx(list(losses(plain).values()), rel=1e-5)
    diffs = weight_diffs(out, plain)
    assert diffs.max() < 1e-4 and diffs.mean() < 1e-6, (diffs.max(), diffs.mean())
    # rank 0 alone prints and writes ckpt.pt; both ranks wrote their shards into the one folder
    # ckpt.pt names
    assert stdout.count("step 20:") == 1 and stdout.count("saved checkpoint") == 2
    ckpt = load_checkpoint(out / "ckpt.pt")
    assert ckpt["sharded"] == "sharded-0000020" and "optimizer" not in ckpt
    assert sorted(p.name for p in out.iterdir()) == [
        ".lock",
        "ckpt.pt",
        "config.json",
        "log.jsonl",
        "sharded-0000020",
    ]
    assert len(list((out / "sharded-0000020").glob("*.distcp"))) == 2


# a plain run in this process reads a sharded checkpoint: without DCP's warning that it found no
# process group (the run says it is one process)
@pytest.mark.filterwarnings("error:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize(
    "first, then",
    [
        pytest.param((2, "fsdp"), (1, "ddp"), marks=FROM_FSDP_ROPE),
        ((1, "fsdp"), (2, "fsdp")),
        ((1, "ddp"), (2, "fsdp")),
    ],
)
def test_sharded_checkpoint_resumes_at_another_process_count(
    pycode_small: Path,
    plain_rope: Path,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    first: tuple,
    then: tuple,
) -> None:
    """Written by 2 FSDP processes and resumed by one plain process, written by one FSDP process and
    resumed by 2, or written whole by one plain process and resumed by 2 under FSDP: the loss curve
    continues as the uninterrupted run's. With rotary positions, as fsdp_rope, whose copy is the
    first case's first 10 iterations (the drift from plain_rope measured at SEED as with learned
    positions: largest weight difference 1.2e-7, mean 2.5e-9 or less)."""
    if first[0] == 2:
        shutil.copytree(request.getfixturevalue("fsdp_rope"), tmp_path, dirs_exist_ok=True)
    else:
        train(
            pycode_small,
            tmp_path,
            "--max_iters=10",
            "--pos_encoding=rope",
            f"--parallel={first[1]}",
        )
    train(
        pycode_small,
        tmp_path,
        "--max_iters=20",
        "--init_from=resume",
        "--pos_encoding=rope",
        f"--parallel={then[1]}",
        procs=then[0],
    )
    resumed, once = losses(tmp_path), losses(plain_rope)
    assert list(resumed) == list(range(1, 21))
    # the sharded folders that no checkpoint names are gone (the FSDP run's, once a plain run has
    # saved)
    assert [p.name for p in tmp_path.glob("sharded-*")] == ["sharded-0000020"] * (then[1] == "fsdp")
    assert list(resumed.values()) == pytest.approx(list(once.values()), rel=1e-5)
    diffs = weight_diffs(tmp_path, plain_rope)
    assert diffs.max() < 1e-4 and diffs.mean() < 1e-6, (diffs.max(), diffs.mean())


@FROM_FSDP_ROPE
def test_the_gathered_checkpoint_samples_and_converts(
    pycode_small: Path, fsdp_rope: Path, tmp_path: Path
) -> None:
    """The gathered ckpt.pt of 2 FSDP processes (fsdp_rope's) samples, exports, and converts
    (to MQA, under 2 FSDP processes); that converted run is also
    test_sigterm_under_fsdp_saves_a_sharded_checkpoint_that_resumes's (merged here, one launch for
    both): SIGTERM to one rank saves a sharded checkpoint, which resumes."""
    r = run(
        [
            "sample.py",
            f"--out_dir={fsdp_rope}",
            "--num_samples=1",
            "--max_new_tokens=20",
            "--start=def ",
            "--temperature=0",
            "--device=cpu",
        ]
    )
    ckpt = load_checkpoint(fsdp_rope / "ckpt.pt")
    model = GPT(GPTConfig(**ckpt["model_config"])).eval()
    model.load_state_dict(ckpt["model"])
    chars = ckpt["data_meta"]["chars"]
    start = torch.tensor([chars.index(c) for c in "def "])[None]
    expected = "".join(chars[i] for i in generate(model, start, 20, temperature=0.0)[0].tolist())
    assert expected in r.stdout
    # export reads the gathered ckpt.pt too (written beside the test, not into the shared run)
    run(["export.py", f"--out_dir={fsdp_rope}", f"--to={tmp_path / 'hf'}"])
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(start).logits[:, -1:], model(start)[0], rtol=0, atol=1e-4)
    out = tmp_path / "mqa"
    mqa = ["--n_kv_head=1", "--pos_encoding=rope", "--parallel=fsdp"]
    stdout, stderr, code = sigterm_rank_1(
        pycode_small, out, f"--init_from=convert:{fsdp_rope}", *mqa
    )
    # the SIGTERM under FSDP: to one rank (pre-emption); both stop at a log step and save
    assert code == 0, stderr[-3000:]
    ckpt = load_checkpoint(out / "ckpt.pt")
    assert ckpt["model_config"]["n_kv_head"] == 1
    assert (
        stdout.count("stopping on a signal to another rank at iteration") == 1
        and "Traceback" not in stderr
    )
    assert (out / ckpt["sharded"]).is_dir() and ckpt["iter_num"] >= 1
    # resumed under FSDP (one process, in this one: it reads both ranks' shards)
    train(
        pycode_small,
        out,
        f"--max_iters={ckpt['iter_num'] + 2}",
        "--init_from=resume",
        *mqa,
    )
    assert list(losses(out))[-2:] == [ckpt["iter_num"] + 1, ckpt["iter_num"] + 2]
    assert sorted(p.name for p in out.glob("sharded-*")) == [f"sharded-{ckpt['iter_num'] + 2:07d}"]


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
    train(pycode_small, tmp_path, "--max_iters=2", "--eval_interval=2", "--parallel=fsdp")
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
