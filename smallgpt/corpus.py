"""The corpus pipeline of the web-scale preparers (data/openwebtext, data/fineweb_edu): a Hugging
Face text corpus, from the hub or from local parquet/json/text files, tokenised with GPT-2's BPE
into a dataset folder (dataset.py's layout) without holding the corpus in memory.
"""

import glob
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from smallgpt.data import settings_of, writing_dataset
from smallgpt.errors import UserError, first_line
from smallgpt.tokenizer import gpt2_encoding


@contextmanager
def reading(source: str, local: bool) -> Iterator[None]:
    """Errors of loading a corpus, or of reading it (a stream reads its files only as it goes), as
    one line: no network, no cache, files that are not what they say (empty ones among them:
    datasets raises StopIteration for an empty JSON file)."""
    import datasets
    import pyarrow

    try:
        yield
    except (
        ConnectionError,
        OSError,
        ValueError,
        StopIteration,
        pyarrow.ArrowException,
        datasets.exceptions.DatasetGenerationError,
    ) as e:
        root = e  # datasets wraps the reader's error (pyarrow's) in its own
        while root.__cause__ is not None:
            root = root.__cause__
        why = type(root).__name__
        if str(root).strip():
            why += f": {first_line(root)}"
        hint = "with no network, pass local parquet/json/text files as --input=PATH"
        if local:
            hint = "are they empty, or not of the kind their names say?"
        raise UserError(f"cannot load {source} ({why}); {hint}") from e


def load_corpus(hub_id: str, name: str | None, local: str | None, streaming: bool) -> object:
    """A Hugging Face text corpus: from the hub, or from local parquet/json/text files (a path or a
    glob)."""
    import datasets

    # datasets would say "Couldn't find cache for ..."
    if local and "://" not in local and not glob.glob(local):
        raise UserError(f"no file matches --input={local}")
    with reading(local or hub_id, bool(local)):
        if local:
            suffix = local.rsplit(".", 1)[-1]
            kind = {"jsonl": "json", "txt": "text"}.get(suffix, suffix)
            return datasets.load_dataset(kind, data_files=local, split="train", streaming=streaming)
        return datasets.load_dataset(
            hub_id, name, split="train", streaming=streaming, trust_remote_code=False
        )


def prepare_corpus(
    ds: object,
    out_dir: Path,
    num_proc: int = 1,
    val_every: int = 2000,
    max_docs: int | None = None,
    text_field: str = "text",
    source: str = "the corpus",
    local: bool = True,
    test_split: bool = True,
    settings: dict | None = None,
) -> None:
    """Tokenise a corpus with GPT-2's BPE, an end-of-text token after each document, every
    val_every-th document into val.bin (with test_split, the one after it into test.bin) and the
    others into train.bin (uint16), through dataset.writing_dataset: an interrupted or failed run
    leaves the previous dataset intact; a re-run starts over."""
    enc = gpt2_encoding()
    ds = tokenized(ds, enc, text_field, max_docs, num_proc)
    counts = write_splits(ds, out_dir, val_every, enc.n_vocab, source, local, test_split, settings)
    written = ", ".join(f"{n:,} {split}" for split, n in counts.items())
    print(f"wrote {out_dir}: {written} tokens")


def tokenized(ds: object, enc: Any, text_field: str, max_docs: int | None, num_proc: int) -> object:
    """ds's first max_docs documents (all of them if None), each as its ids (enc's BPE) and an
    end-of-text token: made as they are read, for a stream."""

    def tokenize(example: dict) -> dict:
        text = example[text_field]
        if not isinstance(text, str):
            raise UserError(f"a document's {text_field!r} is {text!r}, not a string")
        return {"ids": [*enc.encode_ordinary(text), enc.eot_token]}

    streaming = not hasattr(ds, "__len__")
    columns = ds.column_names  # None: a stream that does not say
    if columns is not None and text_field not in columns:
        raise UserError(
            f"the corpus has no {text_field!r} column (its columns: {', '.join(columns)})"
        )
    if not streaming and len(ds) == 0:
        raise UserError("the corpus has no documents")
    if max_docs and streaming:
        ds = ds.take(max_docs)
    elif max_docs:
        ds = ds.select(range(min(max_docs, len(ds))))
    if streaming:
        return ds.map(tokenize)
    return ds.map(tokenize, num_proc=num_proc, desc="tokenizing")


def write_splits(
    ds: object,
    out_dir: Path,
    val_every: int,
    vocab_size: int,
    source: str,
    local: bool,
    test_split: bool = True,
    settings: dict | None = None,
) -> dict[str, int]:
    """Every val_every-th document's ids into out_dir's val.bin (with test_split, the next
    document's into test.bin), the others into train.bin (uint16), and the tokens each split
    got."""
    from tqdm import tqdm

    counts = {"train": 0, "val": 0, **({"test": 0} if test_split else {})}
    names = tuple(f"{split}.bin" for split in counts)
    i = -1
    # the files are renamed into place only after the last document: an error leaves a dataset in
    # out_dir as it was
    with writing_dataset(out_dir, names, settings) as (files, meta), reading(source, local):
        for i, example in enumerate(tqdm(ds, desc=f"writing {out_dir}", unit="doc")):
            split = "train"
            if i % val_every == 0:
                split = "val"
            elif test_split and i % val_every == 1:
                split = "test"
            ids = np.asarray(example["ids"], dtype=np.uint16)
            files[f"{split}.bin"].write(ids.tobytes())
            counts[split] += len(example["ids"])
        if i < 0:
            raise UserError(f"{source} has no documents")
        if not all(counts.values()):
            raise UserError(
                f"{i + 1} documents at val_every={val_every} leave a split empty: more documents, "
                "or a smaller val_every"
            )
        meta.update(
            tokenizer="gpt2",
            vocab_size=vocab_size,
            dtype="uint16",
            **{f"{split}_tokens": n for split, n in counts.items()},
        )
    return counts


@dataclass(slots=True)
class CorpusConfig:
    """The options of the corpus preparers (data/openwebtext, data/fineweb_edu)."""

    input: str | None = None  # local parquet/json/text files (a path or glob) instead of the hub
    out_dir: str = ""
    num_proc: int = 8  # tokenising processes (not used when streaming)
    streaming: bool = False  # read the hub dataset as a stream: little disk, one process
    val_every: int = 2000  # every N-th document goes to val (0.05%, as nanoGPT)
    test_split: bool = True  # the document after each val one goes to test
    max_docs: int | None = None
    subset: str | None = None  # the hub dataset's configuration, if it has several

    def __post_init__(self) -> None:
        if (
            self.val_every < 2 + self.test_split
            or self.num_proc < 1
            or (self.max_docs is not None and self.max_docs < 1)
        ):
            raise ValueError(
                f"val_every={self.val_every} must be at least {2 + self.test_split} (test_split="
                f"{self.test_split}), num_proc={self.num_proc} and "
                f"max_docs={self.max_docs} positive"
            )


def prepare_hub_corpus(cfg: CorpusConfig, hub_id: str) -> None:
    ds = load_corpus(hub_id, cfg.subset, cfg.input, cfg.streaming)
    prepare_corpus(
        ds,
        Path(cfg.out_dir),
        cfg.num_proc,
        cfg.val_every,
        cfg.max_docs,
        source=cfg.input or hub_id,
        local=bool(cfg.input),
        test_split=cfg.test_split,
        settings=settings_of(cfg),
    )
