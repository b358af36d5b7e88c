"""export.py: a trained run out to a transformers folder that stock classes load and that computes,
decodes and tokenizes as this project does."""

import base64
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT, TINY_TRAIN, cli, read_log, run
from smallgpt.checkpoint import load_checkpoint, model_from_checkpoint

# llama.cpp's converter stand-in (the suite has no llama.cpp): one JSON line per run in calls.jsonl
# beside it (its arguments and the files of the folder it converts), and a file that starts as a
# GGUF does
FAKE_CONVERTER = """
import json, os, sys
args = sys.argv[1:]
with open(os.path.join(os.path.dirname(__file__), "calls.jsonl"), "a") as f:
    f.write(json.dumps({"argv": args, "files": sorted(os.listdir(args[0]))}) + "\\n")
open(args[args.index("--outfile") + 1], "wb").write(b"GGUF" + bytes(12))
"""


def fake_llama_cpp(folder: Path) -> Path:
    """A llama.cpp source folder (the converter above, the module gguf.CONVERT patches, a
    llama-simple that records its runs too): the file each call is recorded in."""
    (folder / "conversion").mkdir(parents=True)
    (folder / "conversion" / "__init__.py").write_text("")
    (folder / "conversion" / "base.py").write_text(
        "class TextModel:\n"
        "    def get_vocab_base_pre(self, tokenizer):\n"
        "        raise NotImplementedError\n"
    )
    (folder / "convert_hf_to_gguf.py").write_text(FAKE_CONVERTER)
    simple = folder / "build" / "bin" / "llama-simple"
    simple.parent.mkdir(parents=True)
    simple.write_text(f"#!/bin/sh\necho llama-simple >> {folder / 'calls.jsonl'}\n")
    simple.chmod(0o755)
    return folder / "calls.jsonl"


@pytest.fixture(scope="module")
def char_run(pycode_small: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-iteration run on the char-level dataset, alone in its folder; tests must leave it as it
    is."""
    out = tmp_path_factory.mktemp("char_run") / "run"
    run(
        [
            "train.py",
            f"--dataset={pycode_small}",
            f"--out_dir={out}",
            *TINY_TRAIN,
            "--max_iters=2",
            "--eval_interval=2",
        ]
    )
    return out


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-iteration run on a dataset with its own byte-level BPE (what llama.cpp can read)."""
    tmp = tmp_path_factory.mktemp("bpe_run")
    (tmp / "input.txt").write_text(
        "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n" * 200
    )
    run(
        [
            "dataset.py",
            f"--input={tmp / 'input.txt'}",
            f"--out_dir={tmp / 'data'}",
            "--tokenizer=bpe",
            "--vocab_size=280",
        ]
    )
    run(
        [
            "train.py",
            f"--dataset={tmp / 'data'}",
            f"--out_dir={tmp / 'mybpe'}",
            *TINY_TRAIN,
            "--max_iters=2",
            "--eval_interval=2",
            "--pos_encoding=learned",
        ]
    )
    return tmp / "mybpe"


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under folder and a hash of its bytes: what must be there, unchanged, after a
    refused command."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def refused(r: object, message: str) -> str:
    """The one `error:` line of a refused command, which holds message."""
    assert (
        r.returncode == 2 and len(r.stderr.splitlines()) == 1 and r.stderr.startswith("error: ")
    ), r.stderr
    assert message in r.stderr, r.stderr
    return r.stderr


def load(folder: Path) -> tuple:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval(), AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize(("pos_encoding", "n_kv_head"), [("rope", 2), ("learned", 1)])
def test_export_loads_in_transformers_and_decodes_as_sample_py(
    pycode_small: Path, tmp_path: Path, pos_encoding: str, n_kv_head: int
) -> None:
    out = tmp_path / "out"
    theta = (
        ["--rope_theta=500"] if pos_encoding == "rope" else []
    )  # a rotary key: refused with learned positions
    run(
        [
            "train.py",
            f"--dataset={pycode_small}",
            f"--out_dir={out}",
            *TINY_TRAIN,
            "--max_iters=60",
            "--eval_interval=60",
            f"--pos_encoding={pos_encoding}",
            f"--n_kv_head={n_kv_head}",
            *theta,
        ]
    )
    r = run(["export.py", f"--out_dir={out}"])
    folder = out / "hf"
    assert f"wrote {folder}" in r.stdout and {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "README.md",
    } <= {p.name for p in folder.iterdir()}
    # what transformers 4.57 (llama.cpp's converter's pin) reads besides 5's names: the tokenizer's
    # class by a name both know, and the rotary base at the top level as well as in rope_parameters
    # (docs/export.md)
    assert (
        json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"]
        == "PreTrainedTokenizerFast"
    )
    config = json.loads((folder / "config.json").read_text())
    if pos_encoding == "rope":
        assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 500
    hf, tok = load(folder)
    assert (
        type(hf).__name__
        == {"rope": "Starcoder2ForCausalLM", "learned": "GPTBigCodeForCausalLM"}[pos_encoding]
    )
    ours = model_from_checkpoint(load_checkpoint(out / "ckpt.pt")).eval()
    idx = torch.randint(
        0, ours.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, ours(idx, targets=idx)[0], rtol=0, atol=1e-4)
    # the tokenizer round-trips the dataset's own text and numbers it as the dataset does
    meta = json.loads((pycode_small / "meta.json").read_text())
    val = np.fromfile(pycode_small / "val.bin", dtype=meta["dtype"])[:2000].tolist()
    text = "".join(meta["chars"][i] for i in val)
    assert tok(text)["input_ids"] == val and tok.decode(val) == text
    # greedy text from transformers is sample.py's (within block_size: transformers has no sliding
    # window)
    s = run(
        [
            "sample.py",
            f"--out_dir={out}",
            "--start=def ",
            "--max_new_tokens=24",
            "--temperature=0",
            "--device=cpu",
        ]
    )
    with torch.no_grad():
        ids = hf.generate(
            **tok("def ", return_tensors="pt"), max_new_tokens=24, do_sample=False, pad_token_id=0
        )
    assert len(ids[0]) == 28 and s.stdout.startswith(tok.decode(ids[0]))
    # back in: a run from the exported folder starts from the same model (its first evaluation is
    # the run's last)
    if pos_encoding == "rope":
        shape = (
            "--n_layer=",
            "--n_head=",
            "--n_embd=",
        )  # the weights' own: train.py refuses them with hf:
        run(
            [
                "train.py",
                f"--dataset={pycode_small}",
                f"--out_dir={tmp_path / 'again'}",
                *[a for a in TINY_TRAIN if not a.startswith(shape)],
                f"--init_from=hf:{folder}",
                "--max_iters=1",
                "--eval_interval=1",
            ]
        )
        first = [r for r in read_log(tmp_path / "again") if r["event"] == "eval"][0]
        last = [r for r in read_log(out) if r["event"] == "eval"][-1]
        assert first["iter"] == 0 and first["val_loss"] == pytest.approx(last["val_loss"], abs=1e-5)
    card = (folder / "README.md").read_text()
    assert f"n_kv_head={n_kv_head}" in card and "val loss" in card
    past = {
        "learned": "transformers cannot go past n_positions=32, nor llama.cpp past n_ctx=32",
        "rope": (
            "transformers and llama.cpp both run past 32 tokens, "
            "but the model never saw such positions"
        ),
    }
    assert past[pos_encoding] in card


def test_gpt2_bpe_dataset_exports_its_bpe_tokenizer(tmp_path: Path) -> None:
    bpe = (
        tmp_path / "tiny.tiktoken"
    )  # a byte-level BPE with one merge, in tiktoken's format, stands in for GPT-2's
    ranks = [bytes([i]) for i in range(256)] + [b"th", b"the"]
    bpe.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    env = {"GPT2_BPE_FILE": str(bpe)}
    text = "To be, or not to be, that is the question. The rest is silence.\n" * 40
    (tmp_path / "input.txt").write_text(text)
    run(
        [
            "data/shakespeare/prepare.py",
            f"--input={tmp_path / 'input.txt'}",
            f"--out_dir={tmp_path / 'data'}",
        ],
        env=env,
    )
    out = tmp_path / "out"
    run(
        [
            "train.py",
            f"--dataset={tmp_path / 'data'}",
            f"--out_dir={out}",
            *TINY_TRAIN,
            "--max_iters=2",
            "--eval_interval=2",
            "--pos_encoding=learned",
        ],
        env=env,
    )
    run(["export.py", f"--out_dir={out}", f"--to={tmp_path / 'hf'}"], env=env)
    _, tok = load(tmp_path / "hf")
    import tiktoken  # noqa: F401  (the dataset's own encoding, through dataset.py)

    from smallgpt.tokenizer import gpt2_encoding

    enc = gpt2_encoding(str(bpe))
    sample = "The rest is silence, the question. <|endoftext|>"
    assert tok(sample)["input_ids"] == enc.encode(sample, allowed_special="all")
    assert (
        257 in tok("the")["input_ids"]
        and tok.eos_token_id == 258
        and tok.decode(tok(text)["input_ids"]) == text
    )


def test_export_refuses_what_it_cannot_do_in_one_line(char_run: Path, tmp_path: Path) -> None:
    r = cli(["export.py", f"--out_dir={tmp_path / 'none'}"])
    assert (
        r.returncode == 2
        and r.stderr.startswith("error: no checkpoint at")
        and len(r.stderr.splitlines()) == 1
    )
    out = tmp_path / "out"
    shutil.copytree(char_run, out)
    (tmp_path / "llama").mkdir()
    for args, message in [
        ([f"--gguf={tmp_path / 'm.gguf'}"], "--gguf=FILE and --llama_cpp=DIR go together"),
        (
            [f"--gguf={tmp_path / 'm.gguf'}", f"--llama_cpp={tmp_path / 'llama'}"],
            "no convert_hf_to_gguf.py in --llama_cpp=",
        ),
        (["--gguf_type=q4_0"], "gguf_type='q4_0' must be one of f32, f16, bf16, q8_0"),
    ]:
        r = cli(["export.py", f"--out_dir={out}", f"--to={tmp_path / 'g'}", *args])
        assert r.returncode == 2 and message in r.stderr and len(r.stderr.splitlines()) == 1, (
            r.stderr
        )
    (tmp_path / "llama" / "convert_hf_to_gguf.py").write_text("raise SystemExit('not to be run')\n")
    r = cli(
        [
            "export.py",
            f"--out_dir={out}",
            f"--to={tmp_path / 'g'}",
            f"--gguf={tmp_path / 'm.gguf'}",
            f"--llama_cpp={tmp_path / 'llama'}",
        ]
    )
    assert r.returncode == 2 and "GGUF needs a byte-level BPE vocabulary" in r.stderr, r.stderr
    assert not (tmp_path / "g").exists() and not (tmp_path / "m.gguf").exists()
    # an old checkpoint without the dataset's meta, whose dataset is gone: the tokenizer is unknown
    ckpt = torch.load(out / "ckpt.pt", weights_only=False)
    del ckpt["data_meta"]
    torch.save(
        ckpt | {"config": ckpt["config"] | {"dataset": str(tmp_path / "gone")}}, out / "ckpt.pt"
    )
    r = cli(["export.py", f"--out_dir={out}", f"--to={tmp_path / 'g'}"])
    assert r.returncode == 2 and r.stderr.startswith(f"error: no dataset at {tmp_path / 'gone'}"), (
        r.stderr
    )
    assert not (tmp_path / "g").exists()


def test_overwrite_replaces_an_earlier_export_and_nothing_else(
    char_run: Path, pycode_small: Path, tmp_path: Path
) -> None:
    dest, args = tmp_path / "export", ["export.py", f"--out_dir={char_run}"]
    run([*args, f"--to={dest}"])
    assert (dest / "smallgpt.json").is_file()
    refused(
        cli([*args, f"--to={dest}"]),
        "holds an earlier export: choose another --to, or --overwrite=True",
    )
    (dest / "notes.md").write_text("the user's, put beside the export")
    shutil.copytree(char_run, dest / "run")  # a run put inside an export: a folder no export writes
    before = snapshot(dest)
    refused(
        cli([*args, f"--to={dest}", "--overwrite=True"]),
        "holds an earlier export and notes.md, run, which no export wrote: move them out",
    )
    assert snapshot(dest) == before
    shutil.rmtree(dest / "run")
    (dest / "notes.md").unlink()
    # what an export killed by -9 left beside dest: removed by the next export there, and nothing
    # else is
    stale = tmp_path / ".export.smallgpt-0123abcd"
    shutil.copytree(dest, stale)
    (tmp_path / ".export-mine").write_text("a user's file, of a name like an old temp folder's")
    run([*args, f"--to={dest}", "--overwrite=True"])
    assert json.loads((dest / "smallgpt.json").read_text())["files"] == sorted(
        p.name for p in dest.iterdir()
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [".export-mine", "export"]
    (tmp_path / ".export-mine").unlink()
    # what is no export is never replaced, --overwrite or not: a folder of other files, a dataset, a
    # file
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    data = tmp_path / "data"
    shutil.copytree(pycode_small, data)
    (tmp_path / "file.txt").write_text("mine")
    before = snapshot(tmp_path)
    for to, held in [("mine", "other files"), ("data", "a dataset"), ("file.txt", "a file")]:
        for overwrite in ([], ["--overwrite=True"]):
            line = refused(
                cli([*args, f"--to={tmp_path / to}", *overwrite]), f"holds {held}, not an export"
            )
            assert (
                "--overwrite=True" not in line
            )  # it replaces only an export: no use suggesting it
    assert snapshot(tmp_path) == before


def test_overwrite_never_deletes_the_run_nor_a_folder_holding_it(
    char_run: Path, tmp_path: Path
) -> None:
    before = snapshot(char_run.parent)
    for to in (char_run, char_run.parent):
        refused(
            cli(["export.py", f"--out_dir={char_run}", f"--to={to}", "--overwrite=True"]),
            (
                f"is or contains {char_run.resolve()}: "
                "choose another destination (nothing was deleted)"
            ),
        )
    assert snapshot(char_run.parent) == before
    # --to=. from a folder holding the run (a process of its own: the working directory is the
    # point)
    work = tmp_path / "work"
    shutil.copytree(char_run, work / "run")
    before = snapshot(work)
    r = subprocess.run(
        [sys.executable, str(ROOT / "export.py"), "--out_dir=run", "--to=.", "--overwrite=True"],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=120,
    )
    refused(r, "is or contains")
    assert snapshot(work) == before


def test_a_gguf_setting_without_gguf_is_one_line(tmp_path: Path) -> None:
    """gguf_type is read only by the GGUF conversion: given without --gguf it would change
    nothing, so it is refused before the run is read (the folder holds none)."""
    r = cli(["export.py", f"--out_dir={tmp_path}", "--gguf_type=f16"])
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith("error: gguf_type='f16' is read by the GGUF conversion"), r.stderr
    assert "leave gguf_type out, or give --gguf=FILE" in r.stderr, r.stderr


def test_a_second_export_into_a_folder_being_written_is_refused(
    char_run: Path, tmp_path: Path
) -> None:
    fd = os.open(
        tmp_path, os.O_RDONLY
    )  # what an export under way holds: a lock on the folder it writes into
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        refused(
            cli(["export.py", f"--out_dir={char_run}", f"--to={tmp_path / 'new'}"]),
            f"{tmp_path} is being written by another export (pid {os.getpid()})",
        )
        assert list(tmp_path.iterdir()) == []
    finally:
        os.close(fd)
    run(["export.py", f"--out_dir={char_run}", f"--to={tmp_path / 'new'}"])
    assert [p.name for p in tmp_path.iterdir()] == ["new"]  # the lock leaves no file behind


def test_char_level_tokenizer_refuses_characters_outside_its_vocabulary(
    char_run: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    run(["export.py", f"--out_dir={char_run}", f"--to={tmp_path / 'hf'}"])
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok.decode(tok("def f(x):\n")["input_ids"]) == "def f(x):\n"
    with pytest.raises(
        Exception, match="Missing"
    ):  # tokenizers' own error: never a real token (id 0 was a newline)
        tok("def \u00e9")
    refused(
        cli(
            ["sample.py", f"--init_from=hf:{tmp_path / 'hf'}", "--start=def \u00e9", "--device=cpu"]
        ),
        "characters not in the tokenizer's vocabulary: '\u00e9'",
    )


def test_gguf_alone_keeps_no_folder_is_named_after_the_run_and_replaces_only_a_gguf(
    bpe_run: Path, tmp_path: Path
) -> None:
    calls = fake_llama_cpp(tmp_path / "llama")
    gguf, args = (
        tmp_path / "out" / "m.gguf",
        ["export.py", f"--out_dir={bpe_run}", f"--llama_cpp={tmp_path / 'llama'}"],
    )
    for _ in range(2):  # a second GGUF export is not blocked by a folder the first left behind
        run([*args, f"--gguf={gguf}", "--overwrite=True"])
        assert not (bpe_run / "hf").exists() and gguf.read_bytes().startswith(b"GGUF")
    assert [p.name for p in gguf.parent.iterdir()] == [
        "m.gguf"
    ]  # the converted folder went with its temp folder
    (call, _) = [json.loads(line) for line in calls.read_text().splitlines()]
    argv = call["argv"]
    assert (
        argv[argv.index("--model-name") + 1] == "mybpe"
        and argv[argv.index("--outtype") + 1] == "f32"
    )
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(
        call["files"]
    )
    refused(
        cli([*args, f"--gguf={gguf}"]),
        f"{gguf} is there: choose another --gguf, or --overwrite=True",
    )
    (tmp_path / "notes.txt").write_text("mine")
    line = refused(
        cli([*args, f"--gguf={tmp_path / 'notes.txt'}", "--overwrite=True"]), "is not a GGUF file"
    )
    assert "--overwrite=True" not in line and (tmp_path / "notes.txt").read_text() == "mine"
    run(
        [*args, f"--gguf={tmp_path / 'n.gguf'}", f"--to={tmp_path / 'hf'}"]
    )  # with --to, the folder is kept
    assert (tmp_path / "hf" / "smallgpt.json").is_file() and (tmp_path / "n.gguf").is_file()
