"""Mistakes fixed as classes (issue 42): numbers the code's types cannot hold, damaged or replaced
files, a disk that fills, Ctrl-C from a script's first line, pretrained weights given another shape;
each through the real command line or the real function, with one `error:` line and nothing lost."""

import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from configurator import parse_config
from conftest import NO_PROBE, ROOT, TINY_TRAIN, cli, run, tiny_model
from smallgpt.checkpoint import check_out_dir, save_checkpoint, size_estimate
from smallgpt.data import Batches, load_meta, write_dataset
from smallgpt.errors import UserError
from smallgpt.optim import make_optimizer, state_bytes


def one_line(r: object, message: str) -> None:
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    (line,) = r.stderr.splitlines()
    assert line.startswith("error: ") and message in line, line


@dataclass
class Keys:
    n: int = 1
    lr: float = 1.0
    sizes: list[tuple[int, int] | str] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)
    top_p: float | None = None
    fractions: list[float] = field(default_factory=list)


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--n=9223372036854775808", "does not fit a 64-bit integer"),
        ("--n=-99999999999999999999", "does not fit a 64-bit integer"),
        (
            "--lr=1e-50",
            "is too small for float32, the precision it is used in (it would become zero)",
        ),
        (
            "--lr=1e39",
            "is too large for float32, the precision it is used in (it would become infinity)",
        ),
        (
            "--lr=7e-46",
            "too small for float32",
        ),  # below half the smallest float32 (1.4e-45): rounds to 0
        (
            "--n=0x10",
            "n=0x10 (from flag --n=0x10) has the wrong type: expected int, got str",
        ),  # not read as 16
        ("--sizes=[(1,2,3)]", "expected list[tuple[int, int] | str]"),  # a pair is two numbers
        (
            "--top_p=1e39",
            "top_p=1e+39 (from flag --top_p=1e39) is too large for float32",
        ),  # not "the wrong type"
        (
            "--fractions=[0.5,1e-50]",
            "fractions=1e-50 (from flag --fractions=[0.5,1e-50]) is too small for float32",
        ),
    ],
)
def test_numbers_the_types_cannot_hold_are_refused(flag: str, message: str) -> None:
    with pytest.raises(UserError, match=re.escape(message)):
        parse_config(Keys, [flag])


def test_numbers_are_decimal_and_text_is_taken_as_typed(tmp_path: Path) -> None:
    assert parse_config(Keys, ["--sizes=[0x64]"]).sizes == ["0x64"]  # 0 layers x 64, not 100
    assert parse_config(Keys, ["--sizes=[(1,16),(2,32)]"]).sizes == [[1, 16], [2, 32]]
    assert parse_config(Keys, ["--tags=[1,2e3]"]).tags == ["1", "2e3"]
    assert parse_config(Keys, ["--lr=0", "--n=9223372036854775807"]).n == 2**63 - 1
    assert (
        parse_config(Keys, ["--lr=1e-45"]).lr == 1e-45
    )  # the smallest float32 (a greedy temperature, say)
    (tmp_path / "inf.py").write_text("lr = float('inf')\n")
    with pytest.raises(UserError, match=r"lr=inf \(from config file .*\) must be a finite number"):
        parse_config(Keys, [str(tmp_path / "inf.py")])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--seed=18446744073709551616"],
            "seed=18446744073709551616 (from flag --seed=18446744073709551616) does not fit",
        ),
        (
            ["--learning_rate=1e-60"],
            "learning_rate=1e-60 (from flag --learning_rate=1e-60) is too small for float32",
        ),
        (
            ["--weight_decay=1e300"],
            "weight_decay=1e+300 (from flag --weight_decay=1e300) is too large for float32",
        ),
        (["--init_from=convert:"], "init_from='convert:' names no folder: give convert:<folder>"),
    ],
)
def test_train_numbers_and_sources_out_of_range(
    pycode_small: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    one_line(
        cli(
            [
                "train.py",
                f"--dataset={pycode_small}",
                f"--out_dir={tmp_path / 'out'}",
                *TINY_TRAIN,
                *args,
            ]
        ),
        message,
    )
    assert not (tmp_path / "out").exists()
    if (
        "--init_from=convert:" in args
    ):  # hf: with no folder likewise (no model keys given: they would be refused)
        one_line(
            cli(["train.py", f"--dataset={pycode_small}", "--init_from=hf:"]),
            "init_from='hf:' names no folder",
        )


SCRIPTS = [
    "train.py",
    "sample.py",
    "compare.py",
    "export.py",
    "dataset.py",
    "bench.py",
    *sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("data/*/prepare.py")),
]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/maps")
def test_ctrl_c_while_the_libraries_import_is_one_line() -> None:
    """Every script, interrupted while torch imports (its library just mapped, a second of imports
    to go; configurator came before it): 'interrupted', no traceback, killed by the interrupt
    (status 130 in a shell)."""
    procs = {
        s: subprocess.Popen(
            [sys.executable, s, "--help"],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for s in SCRIPTS
    }
    waiting, deadline = dict(procs), time.time() + 60
    while waiting and time.time() < deadline:
        for script, p in list(waiting.items()):
            maps = Path(f"/proc/{p.pid}/maps")
            if p.poll() is None and "libtorch" in maps.read_text(errors="replace"):
                p.send_signal(signal.SIGINT)
                del waiting[script]
        time.sleep(0.01)
    assert not waiting, f"never began to import torch: {sorted(waiting)}"
    for script, p in procs.items():
        err = p.communicate(timeout=60)[1]
        assert p.returncode in (130, -signal.SIGINT) and err.splitlines() == ["interrupted"], (
            script,
            err,
        )


def test_pretrained_weights_refuse_another_shape_and_record_their_own(
    pycode_small: Path, tmp_path: Path
) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "hf"
    GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=96, n_positions=64)
    ).save_pretrained(folder)
    base = ["train.py", f"--init_from=hf:{folder}", f"--dataset={pycode_small}", "--device=cpu"]
    one_line(
        cli([*base, f"--out_dir={tmp_path / 'a'}", "--n_layer=6"]),
        f"init_from=hf:{folder} trains its weights' own model: drop --n_layer "
        "(of the model keys only dropout, block_size, n_kv_head apply",
    )
    one_line(
        cli([*base, f"--out_dir={tmp_path / 'a'}", "--n_embd=16", "--bias=True"]),
        "drop --n_embd, --bias",
    )
    assert not (tmp_path / "a").exists()


def test_a_pretrained_run_records_the_shape_it_trained(pycode_small: Path, tmp_path: Path) -> None:
    run(
        [
            "train.py",
            f"--dataset={pycode_small}",
            f"--out_dir={tmp_path / 'src'}",
            *TINY_TRAIN,
            NO_PROBE,
            "--n_layer=1",
            "--max_iters=2",
            "--eval_interval=2",
            "--eval_iters=1",
        ]
    )
    run(["export.py", f"--out_dir={tmp_path / 'src'}", f"--to={tmp_path / 'hf'}"])
    run(
        [
            "train.py",
            f"--dataset={pycode_small}",
            f"--out_dir={tmp_path / 'ft'}",
            f"--init_from=hf:{tmp_path / 'hf'}",
            "--block_size=16",
            "--batch_size=4",
            "--max_iters=2",
            "--eval_interval=2",
            "--eval_iters=1",
            "--device=cpu",
            "--dtype=float32",
            NO_PROBE,
        ]
    )
    recorded = json.loads((tmp_path / "ft" / "config.json").read_text())
    ckpt = torch.load(tmp_path / "ft" / "ckpt.pt", weights_only=True)
    for config in (
        recorded,
        ckpt["config"],
        ckpt["model_config"],
    ):  # the folder's 1x32, not TrainConfig's 6x384
        assert (config["n_layer"], config["n_embd"], config["n_head"], config["block_size"]) == (
            1,
            32,
            4,
            16,
        )


def test_a_full_disk_at_a_later_save_is_one_line_and_keeps_the_last_checkpoint(
    tmp_path: Path,
) -> None:
    model = tiny_model()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, model, iter_num=1)
    before = path.read_bytes()
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(
        signal.SIGXFSZ, signal.SIG_IGN
    )  # a write past the limit fails (EFBIG), as on a full disk
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (len(before) // 2, limit[1]))
        with pytest.raises(
            UserError,
            match=r"cannot write checkpoint .*ckpt.pt \(.*\): the disk may be full; any "
            r"previous checkpoint is kept",
        ):
            save_checkpoint(path, model, iter_num=2)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, previous)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


def test_a_full_disk_in_train_py_is_one_line(pycode_small: Path, tmp_path: Path) -> None:
    code = (
        "import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY)); "
        "sys.argv = sys.argv[1:]; runpy.run_path('train.py', run_name='__main__')"
    )
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "train.py",
            f"--dataset={pycode_small}",
            f"--out_dir={tmp_path / 'out'}",
            *TINY_TRAIN,
            NO_PROBE,
            "--max_iters=2",
            "--eval_interval=2",
            "--eval_iters=1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines() == [
        line for line in r.stderr.splitlines() if line.startswith("error: cannot write")
    ]
    assert not (tmp_path / "out" / "ckpt.pt").exists() and not list(
        (tmp_path / "out").glob("*.tmp")
    )


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_the_checkpoint_size_estimate_is_close(
    pycode_small: Path, tmp_path: Path, optimizer: str
) -> None:
    out = tmp_path / "out"
    run(
        [
            "train.py",
            f"--dataset={pycode_small}",
            f"--out_dir={out}",
            *TINY_TRAIN,
            "--max_iters=2",
            "--eval_interval=2",
            "--eval_iters=1",
            f"--optimizer={optimizer}",
        ]
    )
    model = tiny_model(
        n_layer=2,
        n_head=4,
        n_embd=32,
        block_size=32,
        vocab_size=load_meta(pycode_small)["vocab_size"],
    )
    opt = make_optimizer(model, optimizer, 0.1, 1e-3, (0.9, 0.99), "cpu", 0.02)
    estimate, real = (
        size_estimate(model, state_bytes(opt), load_meta(pycode_small)),
        (out / "ckpt.pt").stat().st_size,
    )
    assert real <= estimate <= 1.25 * real, (
        estimate,
        real,
    )  # was 3x the weights + 1 MiB: 2.4x this size


def test_the_free_space_check_counts_keep_last(tmp_path: Path) -> None:
    import shutil

    each = (
        shutil.disk_usage(tmp_path).free // 3
    )  # two fit (the new file beside the old), four do not
    check_out_dir(tmp_path / "a", each, keep_last=0)
    check_out_dir(tmp_path / "a", each, keep_last=1)
    with pytest.raises(UserError, match=r"keep_last=3\): free some space"):
        check_out_dir(tmp_path / "a", each, keep_last=3)


def small_dataset(path: Path, ids: np.ndarray, vocab_size: int = 10) -> Path:
    chars = [chr(97 + i) for i in range(vocab_size)]
    write_dataset(
        path, ids[:900], ids[900:], {"tokenizer": "char", "vocab_size": vocab_size, "chars": chars}
    )
    return path


def test_token_ids_beyond_the_vocabulary_are_one_line(tmp_path: Path) -> None:
    data = small_dataset(tmp_path / "d", np.arange(1000) % 10)
    ids = np.fromfile(data / "train.bin", dtype=np.uint16)
    ids[::50] = 10  # one past the vocabulary, as a file written by another tokenizer would have
    ids.tofile(data / "train.bin")
    r = cli(
        [
            "train.py",
            f"--dataset={data}",
            f"--out_dir={tmp_path / 'out'}",
            *TINY_TRAIN,
            "--block_size=16",
            "--max_iters=2",
            "--eval_interval=2",
            "--eval_iters=1",
        ]
    )
    one_line(
        r, f"{data / 'train.bin'} holds token id 10, beyond the vocab_size 10 of its meta.json"
    )


def test_a_dataset_prepared_again_under_a_run_is_named_so(tmp_path: Path) -> None:
    data = small_dataset(tmp_path / "d", np.arange(1000) % 10)
    batches = Batches(data, 16, 4, 0, "cpu")
    first = batches.train(0, 0)
    assert torch.equal(
        batches.train(0, 0)[0], first[0]
    )  # the same file: the same batch, no complaint
    small_dataset(tmp_path / "d", np.arange(1200) % 7)  # prepared again: other tokens, other counts
    with pytest.raises(
        UserError,
        match=r"train.bin was replaced while this run read it \(the dataset was prepared "
        r"again\)",
    ):
        batches.train(1, 0)


def test_a_bpe_vocabulary_the_text_cannot_fill_is_said(tmp_path: Path) -> None:
    (tmp_path / "in.txt").write_text("abc abd abe " * 50)
    r = run(
        [
            "dataset.py",
            f"--input={tmp_path / 'in.txt'}",
            f"--out_dir={tmp_path / 'd'}",
            "--tokenizer=bpe",
            "--vocab_size=5000",
        ]
    )
    vocab = json.loads((tmp_path / "d" / "meta.json").read_text())["vocab_size"]
    assert (
        vocab < 5000
        and f"the text allows only {vocab:,} BPE tokens, not the 5,000 asked for" in r.stdout
    )
    assert os.path.getsize(tmp_path / "d" / "train.bin") > 0


def test_the_decode_summary_finds_the_step_that_compiled_wherever_it_falls() -> None:
    """The compiled step's 'ready after' is the end of the longest step, not the second (a compile
    that ran at a later step was reported as 'ready after 0.46 s, then 0 tok/s')."""
    from sample import SampleConfig, decode
    from smallgpt.tokenizer import CharTokenizer

    model, calls = tiny_model(), []
    model.register_forward_pre_hook(
        lambda *_: calls.append(1) or time.sleep(0.4 if len(calls) == 6 else 0)
    )
    tok = CharTokenizer([chr(33 + i) for i in range(61)])
    cfg = SampleConfig(max_new_tokens=20, temperature=0, device="cpu")
    _, n_new, times = decode(model, tok, torch.tensor([[1, 2, 3]]), None, cfg)
    (first_s, first_n), (ready_s, ready_n), (last_s, last_n) = times
    assert (
        (first_n, ready_n, last_n, n_new) == (1, 6, 20, 20)
        and ready_s - first_s >= 0.4
        and last_s >= ready_s
    )


def test_no_command_writes_into_a_folder_of_another_kind(
    pycode_small: Path, tmp_path: Path
) -> None:
    """train.py into a dataset, or over a folder's own config.json; dataset.py into a run: refused,
    nothing written."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"mine": true}')
    train = [
        "train.py",
        f"--dataset={pycode_small}",
        *TINY_TRAIN,
        NO_PROBE,
        "--max_iters=2",
        "--eval_interval=2",
    ]
    one_line(
        cli([*train, f"--out_dir={pycode_small}"]),
        f"{pycode_small} holds a dataset, not a run: choose another",
    )
    one_line(
        cli([*train, f"--out_dir={mine}"]),
        f"{mine} holds other files, not a run; its config.json would be replaced",
    )
    assert sorted(p.name for p in mine.iterdir()) == [
        "config.json"
    ] and "ckpt.pt" not in os.listdir(pycode_small)
    run([*train, f"--out_dir={tmp_path / 'run'}", "--eval_iters=1"])
    (tmp_path / "in.txt").write_text("hello world " * 100)
    one_line(
        cli(["dataset.py", f"--input={tmp_path / 'in.txt'}", f"--out_dir={tmp_path / 'run'}"]),
        f"{tmp_path / 'run'} holds a run, not a dataset",
    )
    assert not (tmp_path / "run" / "meta.json").exists()


def test_a_damaged_bpe_tokenizer_file_is_one_line_naming_it(tmp_path: Path) -> None:
    from smallgpt.tokenizer import load_tokenizer

    (tmp_path / "in.txt").write_text("abc abd abe " * 50)
    run(
        [
            "dataset.py",
            f"--input={tmp_path / 'in.txt'}",
            f"--out_dir={tmp_path / 'd'}",
            "--tokenizer=bpe",
            "--vocab_size=270",
        ]
    )
    text = (tmp_path / "d" / "tokenizer.json").read_text()
    (tmp_path / "d" / "tokenizer.json").write_text(text[: len(text) // 2])  # cut short
    with pytest.raises(
        UserError, match=r"the dataset's tokenizer.json is damaged or not a tokenizers file \("
    ):
        load_tokenizer(load_meta(tmp_path / "d"))


def test_a_flag_without_a_key_is_an_unknown_key() -> None:
    with pytest.raises(UserError, match=r"unknown config key '' \(from flag --=5\)"):
        parse_config(Keys, ["--=5"])
