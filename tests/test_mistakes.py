"""User mistakes through the real command line: one `error:` line and exit status 2 (130 for
Ctrl-C), no traceback, nothing written; and one out_dir never holds two runs at once."""

import os
import select
import signal
import string
import subprocess
import sys
import time
from pathlib import Path

import pytest

from configurator import parse_config
from conftest import NO_PROBE, ROOT, TINY_TRAIN, cli, run
from smallgpt.errors import say_interrupted
from train import TrainConfig


def one_line(r: object, message: str) -> None:
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    (line,) = r.stderr.splitlines()
    assert line.startswith("error: ") and message in line, line


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--seed=-1"], "seed=-1 must not be negative"),
        (["--min_lr=0.01", "--learning_rate=0.001"], "min_lr=0.01 is above learning_rate=0.001"),
        (
            ["--lr_decay_iters=50", "--warmup_iters=100"],
            "lr_decay_iters=50 is below warmup_iters=100",
        ),
        (
            ["--optimizer=muon", "--parallel=fsdp"],
            "optimizer='muon' does not go with parallel='fsdp'",
        ),
        (["--out_dir="], "--out_dir= gives out_dir an empty value (an unset shell variable?)"),
        # a key the run would not read: Muon's rate under AdamW, the decay's end with no decay
        (["--muon_lr=0.05"], "muon_lr=0.05 is Muon's rate and optimizer='adamw'"),
        (["--decay_lr=False", "--min_lr=1e-5"], "min_lr=1e-05 shapes the decay and decay_lr=False"),
    ],
)
def test_train_flags_that_make_no_sense(
    pycode_small: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    r = cli(
        [
            "train.py",
            f"--dataset={pycode_small}",
            f"--out_dir={tmp_path / 'out'}",
            *TINY_TRAIN,
            *args,
        ]
    )
    one_line(r, message)
    assert list(tmp_path.iterdir()) == [] and not (ROOT / "ckpt.pt").exists()


def test_config_files_that_raise_or_define_helpers(pycode_small: Path, tmp_path: Path) -> None:
    (tmp_path / "bad.py").write_text("n_layer = 2\nn_embd = undefined_name * 2\n")
    one_line(
        cli(["train.py", str(tmp_path / "bad.py")]),
        f"config file {tmp_path / 'bad.py'} line 2: NameError",
    )
    (tmp_path / "helper.py").write_text("base = 32\nn_embd = base * 2\n")
    one_line(
        cli(["train.py", str(tmp_path / "helper.py")]),
        "a helper variable in a config file starts with _",
    )
    (tmp_path / "private.py").write_text("_base = 32\nn_head = 4\nn_embd = _base * 2\n")
    assert parse_config(TrainConfig, [str(tmp_path / "private.py")]).n_embd == 64


@pytest.fixture(scope="module")
def tiny_run(pycode_small: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "out"
    run(
        [
            "train.py",
            f"--dataset={pycode_small}",
            f"--out_dir={out}",
            *TINY_TRAIN,
            NO_PROBE,
            "--max_iters=20",
            "--eval_interval=20",
        ]
    )
    return out


def test_sample_mistakes_and_near_misses(tiny_run: Path, tmp_path: Path) -> None:
    base = ["sample.py", f"--out_dir={tiny_run}", "--max_new_tokens=30", "--device=cpu"]
    one_line(
        cli([*base, "--kv_cache=False", "--compile=True"]),
        "compile=True compiles the cached one-token step",
    )
    one_line(cli([*base, "--seed=-1"]), "seed=-1 must not be negative")
    one_line(cli([*base, "--start=FILE:"]), "--start=FILE: names no file")
    (tmp_path / "p.txt").write_text("class Foo:")
    r = run(
        [*base, f"--start=file:{tmp_path / 'p.txt'}", "--temperature=0"]
    )  # the prefix in any case
    assert r.stdout.startswith("class Foo:") and "file:" not in r.stdout
    greedy = run([*base, "--start=def ", "--temperature=0"]).stdout
    assert (
        run([*base, "--start=def ", "--temperature=1e-45"]).stdout == greedy
    )  # that small is greedy


def test_a_prompt_in_the_other_unicode_form_and_unknown_characters(tmp_path: Path) -> None:
    (tmp_path / "in.txt").write_text(
        "Cafe\u0301 au lait. " * 300
    )  # the dataset's é is e + a combining accent
    run(["dataset.py", f"--input={tmp_path / 'in.txt'}", f"--out_dir={tmp_path / 'data'}"])
    out = tmp_path / "out"
    run(
        [
            "train.py",
            f"--dataset={tmp_path / 'data'}",
            f"--out_dir={out}",
            *TINY_TRAIN,
            NO_PROBE,
            "--max_iters=2",
            "--eval_interval=2",
        ]
    )
    r = run(
        ["sample.py", f"--out_dir={out}", "--start=Caf\u00e9", "--max_new_tokens=5"]
    )  # a composed é
    assert r.stdout.startswith("Caf\u00e9")
    one_line(
        cli(["sample.py", f"--out_dir={out}", "--start=Café!"]),
        "characters not in the dataset's vocabulary: '!' (U+0021)",
    )
    (tmp_path / "file").write_text("")
    one_line(
        cli(["dataset.py", f"--input={tmp_path / 'in.txt'}", f"--out_dir={tmp_path / 'file'}"]),
        f"out_dir {tmp_path / 'file'} is a file, not a folder",
    )


def test_gpt2_weights_need_their_own_tokens_and_positions(
    pycode_small: Path, tmp_path: Path
) -> None:
    import base64

    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=260, n_positions=64)
    ).save_pretrained(tmp_path / "hf")
    args = [
        "train.py",
        f"--init_from=hf:{tmp_path / 'hf'}",
        "--batch_size=4",
        "--max_iters=2",
        "--device=cpu",
    ]
    one_line(
        cli([*args, f"--dataset={pycode_small}", "--block_size=32", f"--out_dir={tmp_path / 'a'}"]),
        "reads GPT-2's BPE tokens, and dataset",
    )
    bpe = (
        tmp_path / "tiny.tiktoken"
    )  # a byte-level BPE in tiktoken's format stands in for GPT-2's (a download)
    bpe.write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
    env = {"GPT2_BPE_FILE": str(bpe)}
    (tmp_path / "input.txt").write_text("To be, or not to be, that is the question.\n" * 60)
    run(
        [
            "dataset.py",
            f"--input={tmp_path / 'input.txt'}",
            f"--out_dir={tmp_path / 'data'}",
            "--tokenizer=gpt2",
        ],
        env=env,
    )
    one_line(
        cli(
            [
                *args,
                f"--dataset={tmp_path / 'data'}",
                "--block_size=128",
                f"--out_dir={tmp_path / 'b'}",
            ],
            env=env,
        ),
        "block_size=128 is beyond the 64 positions",
    )
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def spawn(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def test_ctrl_c_in_sample_is_one_line_and_status_130(tiny_run: Path) -> None:
    p = spawn(["sample.py", f"--out_dir={tiny_run}", "--max_new_tokens=10000000", "--device=cpu"])
    assert p.stdout.read(20)  # decoding has begun
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert (
        p.returncode == 130 and err.splitlines()[-1] == "interrupted" and "Traceback" not in err
    ), err


def test_one_out_dir_holds_one_run_at_a_time_and_a_killed_holder_leaves_no_lock(
    pycode_small: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    args = ["train.py", f"--dataset={pycode_small}", f"--out_dir={out}", *TINY_TRAIN, NO_PROBE]
    holder = spawn([*args, "--max_iters=100000", "--eval_interval=100000"])
    deadline = time.time() + 60
    # the holder has started: its lock taken and its run's files written (between its config.json
    # and its log, the folder is not yet a run's, and a second run says that instead)
    started = (".lock", "config.json", "log.jsonl")
    while not all((out / name).exists() for name in started) and time.time() < deadline:
        time.sleep(0.02)
    assert (out / ".lock").read_text()
    r = cli([*args, "--max_iters=2", "--init_from=auto"])
    one_line(r, f"{out} is in use by train.py (pid {holder.pid} on ")
    holder.kill()  # kill -9: the OS releases the lock
    holder.wait(timeout=30)
    # the holder's log, of other settings, is refused without a checkpoint (test_nothing_lost.py's
    # case, not the lock's): a user deletes it
    for name in ("log.jsonl", "config.json"):
        (out / name).unlink(missing_ok=True)
    run([*args, "--max_iters=2", "--eval_interval=2", "--init_from=auto"])
    assert (out / "ckpt.pt").is_file()


def test_stop_takes_a_typed_backslash_n_as_the_newline_meant(tiny_run: Path) -> None:
    base = [
        "sample.py",
        f"--out_dir={tiny_run}",
        "--max_new_tokens=300",
        "--temperature=1.0",
        "--start=def ",
    ]
    full = run(base).stdout
    assert "\n" in full.rstrip("\n")[4:]  # the sample (seed 1337) has a newline to stop at
    stopped = run([*base, r"--stop=\n"]).stdout
    assert (
        stopped == full[: full.index("\n", 4) + 1] + "\n"
    )  # kept, then sample.py's own end of line


def test_a_long_sample_does_not_grow_memory(tiny_run: Path, capsys: pytest.CaptureFixture) -> None:
    """sample.py's decoding loop (its streamed text, its timings, the stop-string search) at 200 and
    2,000 tokens: the same peak of Python memory (a loop that kept ~80 bytes a token would add
    144 KB)."""
    import tracemalloc

    import torch

    import sample as sample_script
    from smallgpt.checkpoint import load_checkpoint, model_from_checkpoint
    from smallgpt.tokenizer import load_tokenizer

    ckpt = load_checkpoint(tiny_run / "ckpt.pt")
    model, tok = model_from_checkpoint(ckpt).eval(), load_tokenizer(ckpt["data_meta"])
    warm_up = sample_script.SampleConfig(
        max_new_tokens=5, device="cpu"
    )  # what decoding imports lazily, untraced
    sample_script.decode(model, tok, torch.tensor([tok.encode("def ")]), None, warm_up)
    peaks = []
    for n in (200, 2_000):
        cfg = sample_script.SampleConfig(max_new_tokens=n, stop="\x00", device="cpu")
        tracemalloc.start()
        sample_script.decode(model, tok, torch.tensor([tok.encode("def ")]), None, cfg)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert len(capsys.readouterr().out) > 2_000 and peaks[1] - peaks[0] < 50_000, (
        peaks
    )  # was ~80 bytes a token


def test_convert_takes_the_source_model_keys(
    pycode_small: Path, tiny_run: Path, tmp_path: Path
) -> None:
    run(
        [
            "train.py",
            f"--dataset={pycode_small}",
            f"--out_dir={tmp_path / 'mqa'}",
            f"--init_from=convert:{tiny_run}",
            "--n_kv_head=1",
            "--max_iters=2",
            "--eval_interval=2",
            "--eval_iters=2",
            "--batch_size=4",
            "--device=cpu",
            NO_PROBE,
        ]
    )
    from smallgpt.checkpoint import load_checkpoint

    config = load_checkpoint(tmp_path / "mqa" / "ckpt.pt")["model_config"]
    assert config["n_kv_head"] == 1 and (
        config["n_layer"],
        config["n_embd"],
        config["block_size"],
    ) == (2, 32, 32)


def test_interrupted_is_a_line_of_its_own_after_a_progress_bar(
    capsys: pytest.CaptureFixture,
) -> None:
    """A Ctrl-C that lands while a progress bar is open (the interrupt came before its `with`
    closed it), or while it was being made (its first line drawn, tqdm not yet told: its own close
    would leave the line open), still ends with 'interrupted' on a line of its own."""
    from tqdm import tqdm

    bar = tqdm(total=10, desc="encoding")
    bar.update(3)
    say_interrupted()
    err = capsys.readouterr().err
    assert "encoding" in err and err.splitlines()[-1] == "interrupted"
    bar = tqdm(total=10, desc="encoding")
    del bar.last_print_t  # as at the interrupt, between drawing the line and noting the time
    say_interrupted()
    err = capsys.readouterr().err
    assert "encoding" in err and err.splitlines()[-1] == "interrupted"


def test_ctrl_c_in_dataset_py_writes_nothing(tmp_path: Path) -> None:
    """Ctrl-C while dataset.py encodes (its BPE trained, nothing written yet): status 130,
    'interrupted', and nothing written."""
    # Long enough for the progress bar (8 pieces of 1 MiB, encoded together: the interrupt lands
    # when they are done), in words that a BPE learns and encodes quickly (the repository's code,
    # before, took 3 s to train on and encode)
    line = string.ascii_lowercase + " " + string.ascii_uppercase + "\n"
    (tmp_path / "in.txt").write_text(line * (9_000_000 // len(line) + 1))
    p = subprocess.Popen(
        [
            sys.executable,
            "dataset.py",
            f"--input={tmp_path / 'in.txt'}",
            f"--out_dir={tmp_path / 'data'}",
            "--tokenizer=bpe",
            "--vocab_size=1000",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    err, deadline = b"", time.time() + 120
    while b"encoding" not in err:  # the progress bar's first line: interrupted at once
        ready, _, _ = select.select([p.stderr], [], [], max(0.0, deadline - time.time()))
        chunk = os.read(p.stderr.fileno(), 1 << 16) if ready else b""
        if not chunk:  # ended, or the deadline passed
            break
        err += chunk
    p.send_signal(signal.SIGINT)
    err += p.communicate(timeout=60)[1]
    lines = err.decode().splitlines()
    assert p.returncode == 130 and lines[-1] == "interrupted" and "Traceback" not in "".join(lines)
    assert not (tmp_path / "data" / "meta.json").exists() and not list(tmp_path.glob("data/*.tmp"))
