import base64
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, cli, run
from smallgpt.data import load_meta, open_tokens, write_dataset
from smallgpt.errors import UserError
from smallgpt.tokenizer import CharTokenizer, load_tokenizer


def test_pycode_char_is_deterministic_and_round_trips(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        run(["data/pycode_char/prepare.py", f"--out_dir={out}"])
    for name in ("train.bin", "val.bin", "test.bin", "meta.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    meta = load_meta(a)
    train, val, test = (open_tokens(a, split, meta) for split in ("train", "val", "test"))
    assert (
        meta["tokenizer"] == "char"
        and meta["dtype"] == "uint16"
        and meta["vocab_size"] == len(meta["chars"])
    )
    # nanoGPT's 90/10, the tenth held out in two halves: val, then test
    whole = len(train) + len(val) + len(test)
    assert len(train) == int(whole * 0.9) and len(val) == int(whole * 0.05)
    assert len(train) > 1_000_000 and int(train.max()) < meta["vocab_size"]
    text = load_tokenizer(meta).decode(train[:50000].tolist())
    assert text.startswith("# ") and "def " in text and "import " in text
    assert "/test/" not in text and "site-packages" not in text


def test_char_tokenizer_round_trip_and_unknown_characters() -> None:
    tok = CharTokenizer.from_text("hello world\n")
    ids = tok.encode("low hello")
    assert tok.decode(ids) == "low hello" and tok.encode_array("low hello").tolist() == ids
    with pytest.raises(
        UserError, match=r"not in the dataset's vocabulary: 'X' \(U\+0058\), 'Z' \(U\+005A\)"
    ):
        tok.encode("hello ZX")
    with pytest.raises(UserError, match="'é'"):
        tok.encode_array("helé")


def test_shakespeare_offline_download_fails_with_a_clear_line(tmp_path: Path) -> None:
    out = tmp_path / "shakespeare"
    r = cli(
        [
            "data/shakespeare_char/prepare.py",
            "--url=http://127.0.0.1:9/input.txt",
            f"--out_dir={out}",
        ]
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1
    assert (
        r.stderr.startswith("error: cannot download http://127.0.0.1:9/input.txt")
        and "--input=FILE" in r.stderr
    )
    assert not out.exists()


def test_shakespeare_from_a_local_file(tmp_path: Path) -> None:
    src = tmp_path / "input.txt"
    src.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n" * 50)
    out = tmp_path / "shakespeare"
    run(["data/shakespeare_char/prepare.py", f"--input={src}", f"--out_dir={out}"])
    meta = load_meta(out)
    ids = np.concatenate([open_tokens(out, split, meta) for split in ("train", "val", "test")])
    assert load_tokenizer(meta).decode(ids.tolist()) == src.read_text()
    assert [meta[f"{split}_tokens"] for split in ("train", "val", "test")] == [
        2745,
        152,
        153,
    ]  # 3,050 characters


def test_any_text_file_as_char_or_bpe_dataset(tmp_path: Path) -> None:
    src = tmp_path / "notes.txt"
    src.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    run(["dataset.py", f"--input={src}", f"--out_dir={tmp_path / 'char'}"])
    assert load_meta(tmp_path / "char")["vocab_size"] == len(set(src.read_text()))
    # a tiny byte-level BPE file in tiktoken's format stands in for GPT-2's (which needs a download)
    bpe = tmp_path / "tiny.tiktoken"
    bpe.write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
    run(
        ["dataset.py", f"--input={src}", f"--out_dir={tmp_path / 'bpe'}", "--tokenizer=gpt2"],
        env={"GPT2_BPE_FILE": str(bpe)},
    )
    meta = json.loads((tmp_path / "bpe" / "meta.json").read_text())
    assert meta["tokenizer"] == "gpt2" and meta["vocab_size"] == 257
    ids = np.concatenate(
        [open_tokens(tmp_path / "bpe", split, meta) for split in ("train", "val", "test")]
    )
    assert ids.tolist() == list(src.read_bytes())
    # no test split: the held-out tail is val alone, as before test splits
    run(
        ["dataset.py", f"--input={src}", f"--out_dir={tmp_path / 'two'}", "--val_fraction=0.1"]
        + ["--test_fraction=0"]
    )
    meta = load_meta(tmp_path / "two")
    assert "test_tokens" not in meta and not (tmp_path / "two" / "test.bin").exists()
    assert (meta["train_tokens"], meta["val_tokens"]) == (1620, 180)


def test_gpt2_bpe_offline_is_a_clear_error(tmp_path: Path) -> None:
    src = tmp_path / "notes.txt"
    src.write_text("hello")
    env = {
        "TIKTOKEN_CACHE_DIR": str(tmp_path / "empty-cache"),
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "https_proxy": "http://127.0.0.1:9",
        "GPT2_BPE_FILE": "",
    }
    r = subprocess.run(
        [
            sys.executable,
            "dataset.py",
            f"--input={src}",
            f"--out_dir={tmp_path / 'o'}",
            "--tokenizer=gpt2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "cannot load the GPT-2 BPE" in r.stderr and "GPT2_BPE_FILE" in r.stderr


@pytest.mark.parametrize("damage", ["truncated", "wrong dtype"])
def test_truncated_or_wrong_dtype_token_file_is_detected(tmp_path: Path, damage: str) -> None:
    src = tmp_path / "t.txt"
    src.write_text("abcdefghij" * 100)
    run(["dataset.py", f"--input={src}", f"--out_dir={tmp_path / 'd'}"])
    f = tmp_path / "d" / "train.bin"
    ids = open_tokens(tmp_path / "d", "train", load_meta(tmp_path / "d"))
    f.write_bytes(ids.tobytes()[:-3] if damage == "truncated" else ids.astype(np.int32).tobytes())
    with pytest.raises(UserError, match="truncated or from another preparation"):
        open_tokens(tmp_path / "d", "train", load_meta(tmp_path / "d"))


@pytest.fixture()
def tiny_bpe(tmp_path: Path) -> dict:
    """A byte-level BPE file in tiktoken's format, standing in for GPT-2's (which needs a
    download)."""
    bpe = tmp_path / "tiny.tiktoken"
    bpe.write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
    return {"GPT2_BPE_FILE": str(bpe)}


@pytest.mark.parametrize("script", ["data/openwebtext/prepare.py", "data/fineweb_edu/prepare.py"])
def test_corpus_pipeline_on_local_parquet(script: str, tmp_path: Path, tiny_bpe: dict) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [f"Document {i}: the quick brown fox {i}." + " more" * (i % 5) for i in range(30)]
    pq.write_table(pa.table({"text": docs}), tmp_path / "docs.parquet")
    outs = []
    for streaming in (False, True):
        out = tmp_path / f"out-{streaming}"
        r = run(
            [
                script,
                f"--input={tmp_path / 'docs.parquet'}",
                f"--out_dir={out}",
                "--num_proc=1",
                "--val_every=10",
                f"--streaming={streaming}",
            ],
            env=tiny_bpe,
        )
        assert " train, " in r.stdout and " test tokens" in r.stdout
        outs.append(out)
    meta = load_meta(outs[0])
    train, val, test = (open_tokens(outs[0], split, meta) for split in ("train", "val", "test"))
    eot = 256
    assert meta["tokenizer"] == "gpt2" and meta["dtype"] == "uint16"
    # documents 0, 10, 20 go to val, 1, 11, 21 to test
    assert [int((ids == eot).sum()) for ids in (train, val, test)] == [24, 3, 3]
    assert bytes(val[: val.tolist().index(eot)].tolist()).decode() == docs[0]
    assert bytes(test[: test.tolist().index(eot)].tolist()).decode() == docs[1]
    assert bytes(train[: train.tolist().index(eot)].tolist()).decode() == docs[2]
    # streaming gives the same files; a re-run overwrites whole
    for name in ("train.bin", "val.bin", "test.bin"):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes()
    # and the same meta, but for the settings it records, which say how each was read
    metas = [json.loads((out / "meta.json").read_text()) for out in outs]
    settings = [m.pop("settings") for m in metas]
    assert metas[0] == metas[1] and settings[0] == settings[1] | {"streaming": False}
    assert settings[1]["streaming"] is True and settings[0]["input"] == str(
        tmp_path / "docs.parquet"
    )
    assert not list(outs[0].glob("*.tmp"))
    # a re-run that fails (a document with no text, streamed or not) leaves the dataset there as it
    # was
    files = {p.name: p.read_bytes() for p in outs[0].iterdir()}
    pq.write_table(pa.table({"text": ["a doc", None, "another"]}), tmp_path / "bad.parquet")
    for streaming in (False, True):
        r = cli(
            [
                script,
                f"--input={tmp_path / 'bad.parquet'}",
                f"--out_dir={outs[0]}",
                "--num_proc=1",
                "--val_every=3",
                f"--streaming={streaming}",
            ],
            env=tiny_bpe,
        )
        assert (
            r.returncode == 2
            and r.stderr.splitlines()[-1] == "error: a document's 'text' is None, not a string"
        )
        assert {p.name: p.read_bytes() for p in outs[0].iterdir()} == files


def test_corpus_offline_is_one_clear_line(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "data/openwebtext/prepare.py", f"--out_dir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={
            **os.environ,
            "HF_DATASETS_OFFLINE": "1",
            "HF_HUB_OFFLINE": "1",
            "HF_HOME": str(tmp_path / "hf"),
        },
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1
    assert "cannot load Skylion007/openwebtext" in r.stderr and "--input=PATH" in r.stderr
    r = cli(
        [
            "data/openwebtext/prepare.py",
            f"--input={tmp_path / 'docs-*.parquet'}",
            f"--out_dir={tmp_path / 'd'}",
        ]
    )
    assert (
        r.returncode == 2
        and r.stderr == f"error: no file matches --input={tmp_path / 'docs-*.parquet'}\n"
    )


@pytest.mark.parametrize(
    ("content", "args", "message"),
    [
        (b"", [], "the text is empty"),
        (b"ab\xffcd", [], "is not UTF-8 text (invalid start byte at byte 2)"),
        (
            b"hello world",
            ["--val_fraction=0.01"],
            "11 tokens at val_fraction=0.01, test_fraction=0.05 leave a split empty",
        ),
        (b"hello world", ["--val_fraction=0"], "val_fraction must be in (0, 1)"),
        (b"hello world", ["--val_fraction=0.5", "--test_fraction=0.5"], "their sum below 1"),
        (b"hello world", ["--val_fraction=1.5"], "val_fraction must be in (0, 1)"),
        (None, [], "is not a file"),
    ],
)
def test_unusable_text_is_one_line_and_writes_nothing(
    tmp_path: Path, content: bytes | None, args: list[str], message: str
) -> None:
    source = tmp_path / "in"
    source.mkdir() if content is None else source.write_bytes(content)
    r = cli(["dataset.py", f"--input={source}", f"--out_dir={tmp_path / 'd'}", *args])
    assert r.returncode == 2 and r.stderr.startswith("error: ") and message in r.stderr
    assert len(r.stderr.splitlines()) == 1 and not (tmp_path / "d" / "meta.json").exists()


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        ([1, 2], "not a JSON object"),
        (
            {
                "tokenizer": "char",
                "vocab_size": 3,
                "chars": ["a", "b", "c"],
                "train_tokens": 9,
                "val_tokens": 1,
            },
            "dtype is None, not uint16 or uint32",
        ),
        (
            {
                "tokenizer": "char",
                "vocab_size": 3,
                "chars": ["a", "b", "c"],
                "dtype": "uint16",
            },  # no counts
            "train_tokens is None, not a whole number; val_tokens is None",
        ),
        (
            {
                "tokenizer": "char",
                "vocab_size": 3,
                "chars": ["a", "a", "bc"],
                "dtype": "uint16",
                "train_tokens": 9,
                "val_tokens": 1,
            },
            "a char dataset without its list of characters",
        ),
        (
            {
                "tokenizer": "char",
                "vocab_size": 3,
                "chars": ["a", "a", "b"],
                "dtype": "uint16",
                "train_tokens": 9,
                "val_tokens": 1,
            },
            "3 characters (2 distinct) for vocab_size 3",
        ),
        (
            {
                "tokenizer": "bpe?",
                "vocab_size": 70000,
                "dtype": "uint16",
                "train_tokens": 9,
                "val_tokens": 1,
            },
            "vocab_size 70000 does not fit uint16; tokenizer is 'bpe?'",
        ),
    ],
)
def test_malformed_meta_json_is_one_line(tmp_path: Path, meta: object, message: str) -> None:
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=re.escape(message)):
        load_meta(tmp_path)


def test_bad_preparer_settings_are_one_line(tmp_path: Path) -> None:
    for args, message in (
        (["data/pycode_char/prepare.py", "--max_chars=0"], "max_chars=0 must be at least 2"),
        (["data/openwebtext/prepare.py", "--val_every=0"], "val_every=0 must be at least 3"),
        (
            ["data/openwebtext/prepare.py", "--val_every=2"],
            "val_every=2 must be at least 3 (test_split=True)",
        ),
    ):
        r = cli([*args, f"--out_dir={tmp_path / 'd'}"])
        assert r.returncode == 2 and message in r.stderr and not (tmp_path / "d").exists()


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"content": ["a doc"]}, "the corpus has no 'text' column (its columns: content)"),
        ({"text": ["one doc"]}, "1 documents at val_every=2000 leave a split"),
    ],
)
def test_unusable_corpus_is_one_line(
    tmp_path: Path, tiny_bpe: dict, table: dict, message: str
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table(table, schema=pa.schema([(k, pa.string()) for k in table])),
        tmp_path / "docs.parquet",
    )
    r = cli(
        [
            "data/openwebtext/prepare.py",
            f"--input={tmp_path / 'docs.parquet'}",
            f"--out_dir={tmp_path / 'd'}",
            "--num_proc=1",
        ],
        env=tiny_bpe,
    )
    assert r.returncode == 2 and r.stderr.splitlines()[-1].startswith(f"error: {message}")
    assert not (tmp_path / "d" / "meta.json").exists()


@pytest.mark.parametrize(
    "script", ["data/openwebtext/prepare.py", "data/fineweb_edu/prepare.py"]
)  # whole, streamed
@pytest.mark.parametrize("name", ["docs.parquet", "docs.jsonl"])
def test_an_empty_corpus_file_is_one_line(
    tmp_path: Path, tiny_bpe: dict, script: str, name: str
) -> None:
    """A stream reads its files only as it goes (pyarrow's error comes mid-loop); datasets raises
    StopIteration for an empty JSON file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / name
    if name.endswith(".parquet"):  # a schema and no rows
        pq.write_table(pa.table({"text": pa.array([], pa.string())}), path)
    else:
        path.write_text("")
    r = cli(
        [script, f"--input={path}", f"--out_dir={tmp_path / 'd'}", "--num_proc=1"], env=tiny_bpe
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.splitlines()[-1].startswith(f"error: cannot load {path} (")
    assert r.stderr.splitlines()[-1].endswith(
        "); are they empty, or not of the kind their names say?"
    )
    assert not (tmp_path / "d" / "meta.json").exists()


class CtrlC:
    """Token ids whose reading is interrupted (Ctrl-C) when write_dataset gets to them."""

    def __len__(self) -> int:
        return 100

    def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
        raise KeyboardInterrupt


def test_a_prepare_failing_midway_leaves_the_dataset_there_as_it_was(tmp_path: Path) -> None:
    """Preparing a folder again stops after train.bin's new tokens are written: the dataset already
    there keeps its files as they were (meta.json too, and no temp file beside them) and loads, as
    after a corpus re-run that fails (test_corpus_pipeline_on_local_parquet)."""
    rng = np.random.default_rng(0)
    meta = CharTokenizer([chr(32 + i) for i in range(96)]).meta()
    write_dataset(tmp_path, rng.integers(0, 96, 4000), rng.integers(0, 96, 1000), meta)
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(KeyboardInterrupt):
        write_dataset(tmp_path, rng.integers(0, 96, 3000), CtrlC(), meta)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == files
    loaded = load_meta(tmp_path)
    assert (
        len(open_tokens(tmp_path, "train", loaded)) == 4000
        and len(open_tokens(tmp_path, "val", loaded)) == 1000
    )
