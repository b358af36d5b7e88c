import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import NO_PROBE, ROOT, TINY_TRAIN, Result, cli, read_log, run
from smallgpt.checkpoint import load_checkpoint
from smallgpt.data import load_meta
from smallgpt.errors import UserError


def train(
    data: Path,
    out: Path,
    *extra: str,
    env: dict | None = None,
    fresh: bool = False,
    probe: bool = False,
) -> Result:
    """train.py on data into out with TINY_TRAIN's settings and extra; probe=True lets it measure
    the CPU's peak for MFU (else NO_PROBE gives one)."""
    return run(
        [
            "train.py",
            f"--dataset={data}",
            f"--out_dir={out}",
            *TINY_TRAIN,
            *([] if probe else [NO_PROBE]),
            *extra,
        ],
        env=env,
        fresh=fresh,
    )


def test_training_lowers_val_loss_writes_checkpoint_and_resumes(
    pycode_small: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    train(pycode_small, out, "--max_iters=60", "--eval_interval=30", "--lr_decay_iters=100")
    log = read_log(out)
    evals = [r for r in log if r["event"] == "eval"]
    assert [r["iter"] for r in evals] == [0, 30, 60]
    assert (
        evals[-1]["val_loss"] < evals[0]["val_loss"] - 1.0
    )  # from about ln(vocab) to well below it
    assert [r["iter"] for r in log if r["event"] == "train"] == [10, 20, 30, 40, 50, 60]
    assert (
        log[0]["event"] == "config"
        and log[0]["config"]["max_iters"] == 60
        and log[0]["versions"]["torch"]
    )
    ckpt = load_checkpoint(out / "ckpt.pt")
    assert ckpt["iter_num"] == 60 and ckpt["best_val_loss"] == evals[-1]["val_loss"]
    assert not any(k.startswith(("_orig_mod.", "module.")) for k in ckpt["model"])

    r = train(
        pycode_small,
        out,
        "--init_from=resume",
        "--max_iters=80",
        "--eval_interval=30",
        "--lr_decay_iters=100",
        "--always_save_checkpoint=True",
    )
    log = read_log(out)
    resumed = log[len(evals) + 6 + 1 :]  # after the first run's records
    assert resumed[0]["event"] == "config"
    assert [r["iter"] for r in resumed if r["event"] == "train"] == [70, 80]
    resumed_evals = [r for r in resumed if r["event"] == "eval"]
    assert [r["iter"] for r in resumed_evals] == [60, 80]
    assert (
        abs(resumed_evals[0]["val_loss"] - evals[-1]["val_loss"]) < 1e-6
    )  # the same weights, the same eval batches
    assert load_checkpoint(out / "ckpt.pt")["iter_num"] == 80
    assert "step 60:" in r.stdout


def test_resume_with_another_architecture_is_refused(pycode_small: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    train(pycode_small, out, "--max_iters=10", "--eval_interval=10")
    r = cli(
        [
            "train.py",
            f"--dataset={pycode_small}",
            f"--out_dir={out}",
            *TINY_TRAIN,
            "--init_from=resume",
            "--n_kv_head=2",
            "--max_iters=20",
        ]
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "cannot resume" in r.stderr and "n_kv_head: checkpoint 4, config 2" in r.stderr
    r = cli(
        ["train.py", f"--out_dir={out}", "--init_from=resume", "--n_kv_head=2"]
    )  # the other keys: the run's
    assert (
        r.returncode == 2
        and r.stderr
        == f"error: cannot resume {out}: the config asks for another model "
        "(n_kv_head: checkpoint 4, config 2); drop those overrides or use a new "
        "out_dir\n"
    )


def test_resume_takes_the_keys_not_given_from_the_run(pycode_small: Path, tmp_path: Path) -> None:
    """nanoGPT's resume takes the model's shape from the checkpoint; here every key not given does,
    so --init_from=resume --out_dir=... alone continues a run made with a config file and flags."""
    out = tmp_path / "out"
    train(
        pycode_small,
        out,
        "--max_iters=10",
        "--eval_interval=10",
        "--lr_decay_iters=40",
        "--wandb_tags=['a']",
    )
    vocab = load_checkpoint(out / "ckpt.pt")["model_config"][
        "vocab_size"
    ]  # given as the model has it: accepted
    run(
        [
            "train.py",
            f"--out_dir={out}",
            "--init_from=resume",
            "--max_iters=20",
            f"--vocab_size={vocab}",
        ]
    )
    first, resumed = (r for r in read_log(out) if r["event"] == "config")
    assert resumed["start_iter"] == 10 and resumed["model_config"] == first["model_config"]
    # the model keys as the model is: vocab_size and n_kv_head resolved (None: the dataset's,
    # n_head)
    assert resumed["config"] == first["config"] | first["model_config"] | {
        "init_from": "resume",
        "max_iters": 20,
    }
    assert load_checkpoint(out / "ckpt.pt")["iter_num"] == 20
    ckpt = load_checkpoint(
        out / "ckpt.pt"
    )  # a checkpoint with no run config (an older format): the model's keys
    del ckpt["config"]
    torch.save(ckpt, out / "ckpt.pt")
    run(
        [
            "train.py",
            f"--out_dir={out}",
            "--init_from=resume",
            "--max_iters=30",
            f"--dataset={pycode_small}",
        ]
    )
    last = [r for r in read_log(out) if r["event"] == "config"][-1]
    assert (
        last["config"] | last["model_config"] == last["config"]
        and last["model_config"] == first["model_config"]
    )
    assert load_checkpoint(out / "ckpt.pt")["iter_num"] == 30


def test_missing_dataset_names_the_prepare_script(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="run python data/shakespeare_char/prepare.py first"):
        load_meta(tmp_path / "shakespeare_char")


def test_missing_dataset_path_is_one_line(tmp_path: Path) -> None:
    r = cli(["train.py", f"--dataset={tmp_path / 'nothing'}"])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("error: no dataset at") and len(r.stderr.splitlines()) == 1


def test_block_size_larger_than_the_dataset_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("print('hello')\n" * 40)
    run(["dataset.py", f"--input={tmp_path / 't.txt'}", f"--out_dir={tmp_path / 'd'}"])
    r = cli(
        [
            "train.py",
            f"--dataset={tmp_path / 'd'}",
            f"--out_dir={tmp_path / 'out'}",
            *TINY_TRAIN,
            "--block_size=128",
        ]
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1
    assert "has 30 tokens, fewer than block_size+1=129" in r.stderr  # val: 5% of 600


def test_a_vocabulary_the_model_cannot_hold_is_one_line(tmp_path: Path) -> None:
    """A vocab_size below the dataset's, and a checkpoint resumed on a dataset of other tokens (same
    size or not)."""
    for name, text in (
        ("d", "print('hello')\n" * 40),
        ("digits", "0123456789\n" * 60),
        ("letters", "abcdefghijklmnopqrstuvwxyz\n" * 40),
    ):
        (tmp_path / "t.txt").write_text(text)
        run(["dataset.py", f"--input={tmp_path / 't.txt'}", f"--out_dir={tmp_path / name}"])
    args = [
        f"--dataset={tmp_path / 'd'}",
        f"--out_dir={tmp_path / 'out'}",
        *TINY_TRAIN,
        NO_PROBE,
        "--block_size=8",
    ]
    r = cli(["train.py", *args, "--vocab_size=5"])
    assert r.returncode == 2 and r.stderr.startswith(
        "error: the model's vocab_size=5 is smaller than dataset "
    )
    assert not (tmp_path / "out").exists()
    run(["train.py", *args, "--max_iters=2"])
    for other in ("digits", "letters"):  # fewer tokens than the model holds, and more
        r = cli(["train.py", *args, "--init_from=resume", f"--dataset={tmp_path / other}"])
        assert r.returncode == 2 and r.stderr.startswith(
            "error: the checkpoint was trained on other tokens than dataset"
        )


def test_a_new_run_never_replaces_another_runs_checkpoint(
    pycode_small: Path, tmp_path: Path
) -> None:
    args = [
        "train.py",
        f"--dataset={pycode_small}",
        f"--out_dir={tmp_path}",
        *TINY_TRAIN,
        NO_PROBE,
        "--max_iters=2",
    ]
    run(args)
    before, log = (tmp_path / "ckpt.pt").read_bytes(), (tmp_path / "log.jsonl").read_text()
    for extra in (
        ["--init_from=scratch"],
        [f"--init_from=convert:{tmp_path}"],
        ["--eval_only=True"],
    ):
        r = cli(
            [*args, *extra, "--n_kv_head=1"]
        )  # (eval_only of a new model: its records would join the run's)
        assert r.returncode == 2 and r.stderr == (
            f"error: {tmp_path / 'ckpt.pt'} holds another run: "
            "--init_from=resume (or auto) continues it; "
            "to start a new run, choose another out_dir or delete that one first\n"
        )
    assert (tmp_path / "ckpt.pt").read_bytes() == before and (
        tmp_path / "log.jsonl"
    ).read_text() == log
    run([*args, "--init_from=auto", "--max_iters=3"])  # continues it
    assert load_checkpoint(tmp_path / "ckpt.pt")["iter_num"] == 3
    log, before = (tmp_path / "log.jsonl").read_text(), (tmp_path / "ckpt.pt").read_bytes()
    r = run(
        [*args, "--init_from=auto", "--max_iters=3"]
    )  # run again after its end: done, nothing written
    assert r.stdout.strip().endswith(
        f"{tmp_path / 'ckpt.pt'} is at iteration 3, max_iters=3: nothing to train (raise "
        "--max_iters to train on, or --eval_only=True to evaluate)"
    )
    assert (tmp_path / "log.jsonl").read_text() == log and (
        tmp_path / "ckpt.pt"
    ).read_bytes() == before


def test_eval_only_writes_no_checkpoint(pycode_small: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = train(pycode_small, out, "--eval_only=True")
    assert "step 0: train loss" in r.stdout
    assert not (out / "ckpt.pt").exists()


def test_wandb_offline_records_the_run(pycode_small: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    train(
        pycode_small,
        out,
        "--max_iters=20",
        "--eval_interval=10",
        "--wandb_log=True",
        "--wandb_group=g1",
        "--wandb_tags=MHA,test",
        "--final_evals=[induction]",
        env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"},
        fresh=True,
    )
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb"))
    r = subprocess.run(
        [
            str(Path(sys.executable).parent / "wandb"),
            "leet",
            "inspect",
            "--summary",
            "--json",
            str(runs[0]),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    log = read_log(out)
    last_train = [x for x in log if x["event"] == "train"][-1]
    assert info["summary"]["val_loss"] == [x for x in log if x["event"] == "eval"][-1]["val_loss"]
    assert abs(info["summary"]["loss"] - last_train["loss"]) < 1e-9
    assert set(info["tags"]) == {"MHA", "test"} and info["config"]["wandb_group"] == "g1"
    induction = next(x for x in log if x["event"] == "recall")[
        "induction"
    ]  # the final evals, in the run's summary
    assert [info["summary"][f"induction_acc@{d['distance']}"] for d in induction] == [
        d["accuracy"] for d in induction
    ]
    # resumed, the run goes on in the same wandb run (offline: a second folder with its id, synced
    # into that run)
    train(
        pycode_small,
        out,
        "--init_from=resume",
        "--max_iters=30",
        env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"},
        fresh=True,
    )
    ids = [x["wandb_id"] for x in read_log(out) if x["event"] == "config"]
    assert len(ids) == 2 and ids[0] == ids[1] and runs[0].name.endswith(ids[0])
    assert (
        sorted(p.name[-len(ids[0]) :] for p in (out / "wandb").glob("offline-run-*"))
        == [ids[0]] * 2
    )
    # eval.py --lm_eval's scores go to the run's wandb summary too, in the same wandb run
    run(
        ["eval.py", f"--out_dir={out}", "--lm_eval=[lines]", "--examples=8", "--progress=False"],
        env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"},
        fresh=True,
    )
    folders = sorted((out / "wandb").glob("offline-run-*"))
    assert [p.name[-len(ids[0]) :] for p in folders] == [ids[0]] * 3
    r = subprocess.run(
        [str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--summary", "--json"]
        + [str(folders[-1])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    scored = [x for x in read_log(out) if x["event"] == "benchmarks"]
    assert len(scored) == 1 and scored[0]["iter"] == 30
    assert json.loads(r.stdout)["summary"]["lines_acc"] == scored[0]["lm_eval"]["lines"]["acc"]


def test_float16_off_cuda_and_missing_cuda_are_clear_errors(
    pycode_small: Path, tmp_path: Path
) -> None:
    for flag, msg in [
        ("--dtype=float16", "dtype='float16' needs a GradScaler"),
        ("--device=cuda", "no CUDA GPU"),
    ]:
        if flag == "--device=cuda" and torch.cuda.is_available():
            continue
        r = cli(
            ["train.py", f"--dataset={pycode_small}", f"--out_dir={tmp_path}", "--device=cpu", flag]
        )
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr


def test_unwritable_out_dir_is_one_line(pycode_small: Path, tmp_path: Path) -> None:
    (tmp_path / "a_file").write_text("")
    r = cli(
        [
            "train.py",
            f"--dataset={pycode_small}",
            *TINY_TRAIN,
            f"--out_dir={tmp_path / 'a_file' / 'out'}",
            "--max_iters=1",
        ]
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1
    assert r.stderr.startswith("error:") and "a_file" in r.stderr
    r = cli(
        [
            "train.py",
            f"--dataset={pycode_small}",
            *TINY_TRAIN,
            f"--out_dir={tmp_path / 'a_file'}",
            "--max_iters=1",
        ]
    )
    assert (
        r.returncode == 2
        and r.stderr == f"error: out_dir {tmp_path / 'a_file'} is a file, not a folder\n"
    )


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_reproduces_the_uninterrupted_run_bit_for_bit(
    pycode_small: Path, tmp_path: Path, optimizer: str
) -> None:
    """2N iterations in one go vs N, then a resumed N more: the same losses, bit for bit (CPU,
    float32, dropout on: the torch RNG state travels in the checkpoint; the batches depend on (seed,
    iteration) only; Muon's momentum and AdamW's moments travel in one optimizer state)."""
    args = [
        f"--dataset={pycode_small}",
        *TINY_TRAIN,
        "--log_interval=1",
        "--eval_interval=10",
        "--dropout=0.1",
        "--always_save_checkpoint=True",
        "--lr_decay_iters=20",
        f"--optimizer={optimizer}",
    ]
    train(pycode_small, tmp_path / "once", *args, "--max_iters=20")
    train(pycode_small, tmp_path / "twice", *args, "--max_iters=10")
    train(pycode_small, tmp_path / "twice", *args, "--max_iters=20", "--init_from=resume")
    once = [(r["iter"], r["loss"]) for r in read_log(tmp_path / "once") if r["event"] == "train"]
    twice = [(r["iter"], r["loss"]) for r in read_log(tmp_path / "twice") if r["event"] == "train"]
    assert [i for i, _ in once] == list(range(1, 21)) and once == twice


def test_sigterm_finishes_the_step_saves_and_exits_cleanly(
    pycode_small: Path, tmp_path: Path
) -> None:
    import signal
    import time

    out = tmp_path / "out"
    p = subprocess.Popen(
        [
            sys.executable,
            "train.py",
            f"--dataset={pycode_small}",
            f"--out_dir={out}",
            *TINY_TRAIN,
            NO_PROBE,
            "--log_interval=1",
            "--max_iters=100000",
            "--eval_interval=100000",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def logged_iters() -> int:
        try:
            return sum(r["event"] == "train" for r in read_log(out))
        except (FileNotFoundError, json.JSONDecodeError):  # not there yet, or a line half written
            return 0

    deadline = time.time() + 60
    while time.time() < deadline and logged_iters() < 3:
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=60)
    assert p.returncode == 0, stderr
    assert "stopping on SIGTERM at iteration" in stdout and "Traceback" not in stderr
    ckpt = load_checkpoint(out / "ckpt.pt")
    last_logged = [r["iter"] for r in read_log(out) if r["event"] == "train"][-1]
    assert 3 <= ckpt["iter_num"] == last_logged < 100000
    train(
        pycode_small,
        out,
        f"--max_iters={ckpt['iter_num'] + 2}",
        "--init_from=resume",
        "--log_interval=1",
    )
    assert [r["iter"] for r in read_log(out) if r["event"] == "train"][-2:] == [
        ckpt["iter_num"] + 1,
        ckpt["iter_num"] + 2,
    ]


FAULTS_PER_STEP = """
import resource, statistics, sys, torch
from smallgpt import runtime
from model import GPT, GPTConfig
if sys.argv[1] == "keep":
    runtime.keep_freed_memory()
torch.manual_seed(0)
m = GPT(GPTConfig(n_layer=2, n_head=6, n_embd=384, block_size=32, vocab_size=65))
opt = m.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu")
x = torch.randint(0, 65, (1, 33))
faults = []
for _ in range(9):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    # the bf16 copies of the weights, made again every step
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = m(x[:, :-1], x[:, 1:])[1]
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(statistics.median(faults[2:]))  # after two steps of warm-up
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="mallopt and page-fault counts are glibc/Linux"
)
def test_keep_freed_memory_stops_the_page_faults_of_each_step() -> None:
    """What a bf16 training step frees (autocast's bf16 copies of the weights, activations) stays in
    the process, so the next step does not fault those pages in again. A batch of one short sequence
    keeps the step fast on CPUs without native bf16; the weight copies, ~1 MiB each, are what glibc
    would hand back."""
    faults = {
        mode: float(
            subprocess.run(
                [sys.executable, "-c", FAULTS_PER_STEP, mode],
                cwd=ROOT,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        )
        for mode in ("default", "keep")
    }
    assert faults["keep"] * 10 < faults["default"], faults


def test_an_mfu_over_100_percent_probes_the_cpu_peak_again(
    pycode_small: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU peak probe run while another process had the cores measures too low a rate, and MFU
    comes out over 100%: the first log step that sees it probes again and keeps the higher rate, so
    no MFU over 100% is logged."""
    from smallgpt import runtime

    probes, real = [], runtime.peak_flops

    def probe(device: str, dtype: torch.dtype) -> float:
        probes.append(
            real(device, dtype) if probes else 1e6
        )  # the first as on a busy box, far too low
        return probes[-1]

    monkeypatch.setattr(runtime, "peak_flops", probe)
    train(
        pycode_small,
        tmp_path,
        "--max_iters=20",
        "--eval_interval=20",
        "--log_interval=5",
        probe=True,
    )
    mfus = [r["mfu"] for r in read_log(tmp_path) if r["event"] == "train"]
    assert len(probes) == 2 and probes[1] > 1e9  # probed again once, a real rate
    assert len(mfus) == 4 and all(0 < m < 1 for m in mfus), mfus


def test_bad_optimizer_and_muon_under_fsdp_are_one_line(pycode_small: Path, tmp_path: Path) -> None:
    for flags in (
        ["--optimizer=sgd"],
        ["--optimizer=muon", "--parallel=fsdp"],
        ["--parallel=zero"],
    ):
        r = cli(
            ["train.py", f"--dataset={pycode_small}", f"--out_dir={tmp_path}", *TINY_TRAIN, *flags]
        )
        assert (
            r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1
        ), r.stderr
        assert (
            r.stderr.startswith("error: invalid config: ") and flags[-1].split("=")[1] in r.stderr
        )


@pytest.fixture(scope="module")
def named_dtype_runs() -> dict[tuple[int, str], tuple[str, list[float]]]:
    """{(n_embd, dtype): (config line, losses)} of the runs with a named dtype: the CPU's flags and
    speeds that the test below sets do not reach them (resolve_dtype takes a named dtype as asked),
    so both of its cases read the same three runs, each made once."""
    return {}


@pytest.mark.xdist_group("dtype_auto")  # both cases in one worker: they share named_dtype_runs
@pytest.mark.parametrize("native", [False, True])
def test_dtype_auto_trains_in_bf16_only_where_its_products_measure_faster(
    native: bool,
    pycode_small: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    named_dtype_runs: dict[tuple[int, str], tuple[str, list[float]]],
) -> None:
    """dtype=auto on CPU: bf16 autocast where the CPU has bf16 instructions (/proc/cpuinfo's flags)
    and its bf16 products at the model's width measure at least BF16_MIN_SPEEDUP times faster than
    fp32's, float32 otherwise; the choice and its reason are printed, and the run trains exactly as
    with that dtype named. The CPU's flags and speeds are set here (as on a CPU with AMX, and as on
    one whose bf16 is slow or missing); the probe is the real one in
    test_bf16_speedup_probe_measures_both_dtypes."""
    from smallgpt import runtime

    monkeypatch.setattr(runtime, "native_bf16", lambda: native)
    monkeypatch.setattr(runtime, "bf16_speedup", lambda width: 3.0 if width >= 64 else 0.8)

    def losses(width: int, dtype: str) -> tuple[str, list[float]]:
        if (width, dtype) in named_dtype_runs:
            return named_dtype_runs[width, dtype]
        out = tmp_path / f"{width}-{dtype}"
        r = train(
            pycode_small,
            out,
            f"--dtype={dtype}",
            f"--n_embd={width}",
            "--max_iters=4",
            "--log_interval=1",
            "--eval_interval=4",
        )
        line = next(x for x in r.stdout.splitlines() if x.startswith("config ("))
        result = line, [x["loss"] for x in read_log(out) if x["event"] == "train"]
        if dtype != "auto":
            named_dtype_runs[width, dtype] = result
        return result

    line, narrow_auto = losses(32, "auto")
    assert (
        "torch.float32" in line
        and ("0.80x fp32's at n_embd 32" if native else "cpu without native bf16") in line
    )
    assert narrow_auto == losses(32, "float32")[1]
    line, wide_auto = losses(64, "auto")
    want = "bfloat16" if native else "float32"
    assert (
        f"torch.{want}" in line
        and ("3.00x fp32's at n_embd 64" if native else "without native bf16") in line
    )
    assert wide_auto == losses(64, want)[1]
    assert (
        wide_auto != losses(64, "float32" if native else "bfloat16")[1]
    )  # the two dtypes do differ here


def test_bf16_speedup_probe_measures_both_dtypes() -> None:
    from smallgpt import runtime

    speedup = runtime.bf16_speedup(32, rows=64)
    # a ratio of two measured times, whatever this CPU is and however busy: no band on its size
    # (a loaded box measured 0.0075 here beside the rest of the suite; speeds live in bench.py)
    assert math.isfinite(speedup) and speedup > 0


def test_dtype_auto_decodes_in_bf16_only_with_the_compiled_step_on_a_native_bf16_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from smallgpt import runtime

    for native in (False, True):
        monkeypatch.setattr(runtime, "native_bf16", lambda native=native: native)
        assert runtime.resolve_dtype("auto", "cpu", compiled_decode=True)[0] == (
            torch.bfloat16 if native else torch.float32
        )
        assert (
            runtime.resolve_dtype("auto", "cpu")[0] == torch.float32
        )  # eager bf16 decoding is slower on CPU
        assert runtime.resolve_dtype("float32", "cpu", compiled_decode=True) == (
            torch.float32,
            "as asked",
        )


def test_gpu_peaks_are_found_by_the_most_specific_name() -> None:
    """MFU's denominator: an H100 PCIe (756 TFLOP/s bf16) is not the SXM (989), an L40S not an L40,
    an A100 not an A10; names as torch.cuda.get_device_name gives them."""
    from smallgpt import runtime

    bf16, fp32 = torch.bfloat16, torch.float32
    assert runtime.gpu_peak_flops("NVIDIA H100 80GB HBM3", bf16) == 989e12
    assert runtime.gpu_peak_flops("NVIDIA H100 PCIe", bf16) == 756e12
    assert runtime.gpu_peak_flops("NVIDIA H100 PCIe", fp32) == 51e12
    assert runtime.gpu_peak_flops("NVIDIA H100 NVL", bf16) == 835e12
    assert runtime.gpu_peak_flops("NVIDIA L40S", bf16) == 362e12
    assert runtime.gpu_peak_flops("NVIDIA L40", bf16) == 181e12
    assert runtime.gpu_peak_flops("NVIDIA A100-SXM4-80GB", bf16) == 312e12
    assert (
        runtime.gpu_peak_flops("NVIDIA A10", bf16) == 125e12
        and runtime.gpu_peak_flops("Tesla P4", bf16) is None
    )


def test_each_rank_restores_its_own_generators_and_an_older_checkpoint_still_loads() -> None:
    """runtime.set_rng_states: a rank takes its own entry of the checkpoint's list; a rank it has
    none for (resumed on more processes) starts as that rank of a new run (seed_rank); an older
    checkpoint's one dict is rank 0's."""
    from smallgpt import runtime

    ranks = [runtime.Dist(r, r, 3, "cpu", r == 0) for r in range(3)]
    saved, draws = [], []
    for r in range(2):  # the states of a 2-process run's ranks, and what each draws next
        runtime.seed_rank(7, r)
        torch.rand(5)
        saved += runtime.rng_states(runtime.Dist(0, 0, 1, "cpu", True))
        draws.append(torch.rand(4))
    assert not torch.equal(draws[0], draws[1])
    for r in range(2):
        runtime.set_rng_states(saved, ranks[r], seed=7)
        assert torch.equal(torch.rand(4), draws[r])
    runtime.set_rng_states(saved, ranks[2], seed=7)
    resumed = torch.rand(4)
    runtime.seed_rank(7, 2)
    assert torch.equal(resumed, torch.rand(4))
    runtime.set_rng_states(
        saved[0], ranks[0], seed=7
    )  # an older checkpoint: rank 0's states alone, as a dict
    assert torch.equal(torch.rand(4), draws[0])
