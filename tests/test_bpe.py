"""dataset.py --tokenizer=bpe: a byte-level BPE trained on the input by Hugging Face tokenizers,
kept with the dataset as tokenizer.json, and the tokenizer of train.py, sample.py and export.py for
that dataset."""

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, TINY_TRAIN, cli, run
from smallgpt.data import load_meta
from smallgpt.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def text() -> str:
    """Code with indentation runs and blank lines, and characters of 2-4 UTF-8 bytes, which BPE
    tokens split."""
    src = "".join(
        (ROOT / name).read_text()
        for name in ("smallgpt/data.py", "model.py", "smallgpt/generation.py")
    )
    return src + "naïve café — 数据集 🚀 done\n\n\n    \t x  y\n" * 20


def test_bpe_dataset_has_the_vocabulary_asked_for_and_round_trips(
    tmp_path: Path, text: str
) -> None:
    (tmp_path / "in.txt").write_text(text)
    out = tmp_path / "data"
    run(
        [
            "dataset.py",
            f"--input={tmp_path / 'in.txt'}",
            f"--out_dir={out}",
            "--tokenizer=bpe",
            "--vocab_size=600",
        ]
    )
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"] == "bpe" and meta["vocab_size"] == 600 and "bpe" not in meta
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size() == 600
    ids = np.concatenate(
        [np.fromfile(out / f"{s}.bin", dtype=meta["dtype"]) for s in ("train", "val", "test")]
    ).tolist()
    assert max(ids) < 600 and len(ids) < 0.5 * len(
        text.encode()
    )  # merges learned: well under a token a byte
    tok = load_tokenizer(load_meta(out))
    assert tok.decode(ids) == text and tok.encode(text) == ids
    # encode_array's pieces (cut every ~200 characters here) give the ids of one encode of the whole
    # text
    assert tok.encode_array(text, piece_chars=200).tolist() == ids
    # token by token, the bytes join to the text's: tokens end inside 2-4 byte characters
    assert b"".join(tok.decode_bytes([i]) for i in ids) == text.encode()
    assert any(
        not tok.decode([i]).isprintable() and tok.decode([i]) not in "\n\t" for i in set(ids)
    )
    assert tok.encode("<|endoftext|>") == [tok.eot_token] and tok.n_vocab == 600


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tokenizer=bpe"], "tokenizer='bpe' needs --vocab_size=N"),
        (
            ["--tokenizer=bpe", "--vocab_size=200"],
            "vocab_size=200 for a byte-level BPE must be above 257",
        ),
        (
            ["--vocab_size=600"],
            "vocab_size is for tokenizer='bpe'; a char dataset's vocabulary is fixed",
        ),
    ],
)
def test_bpe_mistakes_are_one_line_and_write_nothing(
    tmp_path: Path, args: list[str], message: str
) -> None:
    (tmp_path / "in.txt").write_text("some text to tokenise\n" * 50)
    r = cli(
        ["dataset.py", f"--input={tmp_path / 'in.txt'}", f"--out_dir={tmp_path / 'data'}", *args]
    )
    assert (
        r.returncode == 2
        and r.stderr.startswith(f"error: {message}")
        and len(r.stderr.splitlines()) == 1
    )
    assert not (tmp_path / "data").exists()


def test_a_bpe_run_samples_and_exports_with_its_own_tokenizer(tmp_path: Path, text: str) -> None:
    (tmp_path / "in.txt").write_text(text)
    data, out = tmp_path / "data", tmp_path / "out"
    run(
        [
            "dataset.py",
            f"--input={tmp_path / 'in.txt'}",
            f"--out_dir={data}",
            "--tokenizer=bpe",
            "--vocab_size=400",
        ]
    )
    run(
        [
            "train.py",
            f"--dataset={data}",
            f"--out_dir={out}",
            *TINY_TRAIN,
            "--max_iters=40",
            "--eval_interval=40",
            "--pos_encoding=rope",
            "--n_kv_head=2",
        ]
    )
    prompt = "def naïve_é"
    ours = run(
        [
            "sample.py",
            f"--out_dir={out}",
            f"--start={prompt}",
            "--max_new_tokens=20",
            "--temperature=0",
        ]
    )
    assert ours.stdout.startswith(prompt) and len(ours.stdout) > len(prompt) + 5
    run(["export.py", f"--out_dir={out}"])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf, tok = (
        AutoModelForCausalLM.from_pretrained(out / "hf").eval(),
        AutoTokenizer.from_pretrained(out / "hf"),
    )
    meta = load_meta(data)
    val = np.fromfile(data / "val.bin", dtype=meta["dtype"]).tolist()
    val_text = load_tokenizer(meta).decode(val)
    assert (
        tok(val_text)["input_ids"] == val
        and tok.decode(val) == val_text
        and tok.eos_token == "<|endoftext|>"
    )
    ids = hf.generate(
        **tok(prompt, return_tensors="pt"),
        max_new_tokens=20,
        do_sample=False,
        pad_token_id=tok.eos_token_id,
    )
    assert tok.decode(ids[0]) == ours.stdout.rstrip("\n")
    # sample.py on the exported folder reads the folder's own tokenizer, not GPT-2's
    again = run(
        [
            "sample.py",
            f"--init_from=hf:{out / 'hf'}",
            f"--start={prompt}",
            "--max_new_tokens=20",
            "--temperature=0",
        ]
    )
    assert again.stdout == ours.stdout
