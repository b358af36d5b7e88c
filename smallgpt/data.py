"""Token datasets on disk, as nanoGPT lays them out: data/<name>/{train,val}.bin (flat token ids) +
meta.json, and the training batches drawn from them. A dataset may hold a test split too, test.bin:
read only at a run's end, so that a choice made on val (a learning rate, compare.py --lrs) is
measured on tokens it never saw.

meta.json (JSON, not pickle, so loading a dataset cannot run code) holds the token dtype, vocab_size
and the tokenizer: 'char' with its character list, 'gpt2' (tiktoken BPE), or 'bpe' (a byte-level BPE
trained on the text by Hugging Face tokenizers, kept beside it as tokenizer.json). The root's
dataset.py is the command line that turns any local text file into such a dataset (prepare_text).
"""

import dataclasses
import json
import os
import re
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np
import torch

from smallgpt.atomic import atomic_open, check_writes_into, folder_lock, remove_stale_temps
from smallgpt.errors import UserError
from smallgpt.tokenizer import BPE_FILE, CharTokenizer, gpt2_encoding, train_bpe

DATA_ROOT = Path(__file__).resolve().parent.parent / "data"  # the repository's data/


def data_dir(dataset: str) -> Path:
    """A dataset name (a folder under data/) or a path to a dataset folder."""
    return Path(dataset) if os.sep in dataset or dataset.startswith(".") else DATA_ROOT / dataset


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


# The files a preparation writes besides meta.json: token splits, MQAR's answer masks and a BPE
# tokenizer. meta.json lists those it wrote ("files"); only such names are ever removed.
DATASET_FILES = re.compile(rf"(train|val|test)(_mask)?\.bin|{re.escape(BPE_FILE)}")


def settings_of(config: object) -> dict:
    """A preparation's settings as its dataset's meta.json records them ("settings"): its config's
    fields but where it writes (out_dir), so that a cached dataset is reused only for the same."""
    return {k: v for k, v in dataclasses.asdict(config).items() if k != "out_dir"}


def earlier_files(out_dir: Path) -> set[str]:
    """The files the dataset in out_dir holds by an earlier preparation: those its meta.json lists,
    or, for a meta from before the list, every file of a dataset's names there; none where there is
    no dataset (a user's files beside no meta.json are not the project's)."""
    try:
        meta = json.loads((out_dir / "meta.json").read_text())
    except (OSError, ValueError):  # no dataset, or a damaged meta
        return set()
    if meta_problems(meta):  # a meta.json of the user's, not a dataset's: none of it is ours
        return set()
    listed = meta.get("files")
    if not isinstance(listed, list):
        listed = [p.name for p in out_dir.iterdir()]
    return {name for name in listed if isinstance(name, str) and DATASET_FILES.fullmatch(name)}


@contextmanager
def writing_dataset(
    out_dir: Path, names: tuple[str, ...] = ("train.bin", "val.bin"), settings: dict | None = None
) -> Iterator[tuple[dict, dict]]:
    """Write a dataset folder: the block writes the named files ({name: binary temp file}) and fills
    the meta dict; then meta.json is removed, so are an earlier preparation's files that this one
    does not write (a test split, masks, a tokenizer: nothing of it is left beside the new meta),
    the files are renamed into place and meta.json is written, last, listing them and the
    preparation's settings (settings_of). A failure in the block leaves a dataset in out_dir as it
    was; a folder without meta.json is never taken as complete (load_meta)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"out_dir {out_dir} is a file, not a folder: choose another --out_dir")
    files = (*names, "meta.json")
    check_writes_into(out_dir, "a dataset", files)  # e.g. not into a run or an export
    meta: dict = {}
    # one writer at a time
    with folder_lock(out_dir, "a dataset's preparation"), ExitStack() as stack:
        remove_stale_temps(out_dir, "|".join(map(re.escape, files)))  # a killed one's
        earlier = earlier_files(out_dir)
        # the temp files are renamed when the stack closes, after meta.json is gone
        yield {name: stack.enter_context(atomic_open(out_dir / name)) for name in names}, meta
        (out_dir / "meta.json").unlink(missing_ok=True)
        for name in sorted(earlier - set(names)):
            (out_dir / name).unlink(missing_ok=True)
        stack.close()
        meta["files"] = list(names)
        if settings is not None:
            meta["settings"] = settings
        with atomic_open(out_dir / "meta.json", "w") as f:
            json.dump(meta, f, indent=1)


def write_dataset(
    out_dir: Path,
    train_ids: np.ndarray,
    val_ids: np.ndarray,
    meta: dict,
    test_ids: np.ndarray | None = None,
    settings: dict | None = None,
) -> None:
    """Write train.bin, val.bin (test.bin, given test_ids; a 'bpe' meta's tokenizer.json), then
    meta.json, with the preparation's settings (writing_dataset)."""
    dtype = token_dtype(meta["vocab_size"])
    bpe = meta.get("bpe")
    splits = {"train": train_ids, "val": val_ids}
    if test_ids is not None:
        splits["test"] = test_ids
    names = tuple(f"{split}.bin" for split in splits)
    if bpe is not None:
        names += (BPE_FILE,)
    with writing_dataset(out_dir, names, settings) as (files, written):
        if bpe is not None:
            files[BPE_FILE].write(bpe.encode())
        for split, ids in splits.items():
            files[f"{split}.bin"].write(np.asarray(ids, dtype=dtype).tobytes())
        written.update(
            {k: v for k, v in meta.items() if k != "bpe"},
            dtype=dtype.name,
            **{f"{split}_tokens": int(len(ids)) for split, ids in splits.items()},
        )
    counts = ", ".join(f"{len(ids):,} {split}" for split, ids in splits.items())
    print(f"wrote {out_dir}: {counts} tokens, vocab_size {meta['vocab_size']}")


def load_meta(path: Path) -> dict:
    file = path / "meta.json"
    if not file.is_file():
        hint = "prepare it first (python dataset.py --help)"
        here = Path(path.name)  # a bare name is data/<name>; the user may mean a folder here
        if path == DATA_ROOT / path.name and (here / "meta.json").is_file():
            hint = (
                f"a name is a folder under {DATA_ROOT}; for the dataset in ./{path.name}, give "
                f"its path: --dataset=./{path.name}"
            )
        elif (DATA_ROOT / path.name / "prepare.py").is_file():
            hint = f"run python data/{path.name}/prepare.py first"
        raise UserError(f"no dataset at {path} (missing meta.json): {hint}")
    try:
        meta = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{file} is not valid JSON ({e}); prepare the dataset again") from e
    if problems := meta_problems(meta):
        raise UserError(
            f"{file} is damaged or not a dataset's meta ({'; '.join(problems)}): prepare the "
            "dataset again"
        )
    # the tokenizer travels with the meta (into checkpoints, to export.py)
    if meta.get("tokenizer") == "bpe":
        if not (path / BPE_FILE).is_file():
            raise UserError(
                f"{path / BPE_FILE} is missing (the dataset's BPE tokenizer); prepare the dataset "
                "again"
            )
        meta["bpe"] = (path / BPE_FILE).read_text(encoding="utf-8")
    return meta


def meta_problems(meta: object) -> list[str]:
    """What is missing or wrong in a dataset's meta.json: the fields that reading its tokens relies
    on."""
    if not isinstance(meta, dict):
        return ["not a JSON object"]
    counts = ("vocab_size", *(f"{split}_tokens" for split in splits_of(meta)))
    problems = [
        f"{k} is {meta.get(k)!r}, not a whole number"
        for k in counts
        if not isinstance(meta.get(k), int) or isinstance(meta.get(k), bool) or meta[k] < 0
    ]
    vocab_size = meta.get("vocab_size")
    if meta.get("dtype") not in ("uint16", "uint32"):
        problems.append(f"dtype is {meta.get('dtype')!r}, not uint16 or uint32")
    elif isinstance(vocab_size, int) and vocab_size > np.iinfo(meta["dtype"]).max + 1:
        problems.append(f"vocab_size {vocab_size} does not fit {meta['dtype']}")
    # a dataset of whole examples, each its own training row (data/mqar)
    examples = meta.get("example_tokens")
    if examples is not None:
        whole = isinstance(examples, int) and examples > 1
        splits = [meta.get(f"{split}_tokens") for split in splits_of(meta)]
        if not whole or any(isinstance(n, int) and n % examples for n in splits):
            problems.append(
                f"example_tokens is {examples!r}, not a whole number above 1 that divides every "
                "split"
            )
    if meta.get("tokenizer") not in ("char", "gpt2", "bpe"):
        problems.append(f"tokenizer is {meta.get('tokenizer')!r}, not char, gpt2 or bpe")
    elif meta["tokenizer"] == "char":
        chars = meta.get("chars")
        listed = isinstance(chars, list)
        if not listed or not all(isinstance(c, str) and len(c) == 1 for c in chars):
            problems.append("a char dataset without its list of characters")
        elif len(set(chars)) != len(chars) or len(chars) != meta.get("vocab_size"):
            problems.append(
                f"{len(chars)} characters ({len(set(chars))} distinct) for vocab_size "
                f"{meta.get('vocab_size')}"
            )
    return problems


def splits_of(meta: dict) -> tuple[str, ...]:
    """The dataset's splits: train and val, and test where it has one (one prepared before test
    splits existed has none)."""
    return ("train", "val", "test") if "test_tokens" in meta else ("train", "val")


def vocab_size_of(dataset: str) -> int | None:
    """The dataset's vocab_size if it has been prepared, else None."""
    if not (data_dir(dataset) / "meta.json").is_file():
        return None
    return load_meta(data_dir(dataset))["vocab_size"]


def open_tokens(path: Path, split: str, meta: dict, mask: bool = False) -> np.memmap:
    """The split's token ids as a read-only memmap, after checking the file against meta.json; mask:
    its loss mask instead (an example dataset's <split>_mask.bin, one byte a token: 1 where the
    token is a target to learn)."""
    file = path / (f"{split}_mask.bin" if mask else f"{split}.bin")
    if not file.is_file():
        raise UserError(f"{file} is missing; prepare the dataset again")
    dtype = np.dtype(np.uint8 if mask else meta["dtype"])
    size = file.stat().st_size
    expected = meta[f"{split}_tokens"]
    if size != expected * dtype.itemsize:
        raise UserError(
            f"{file} has {size:,} bytes, but meta.json says {expected:,} tokens of {dtype.name} "
            f"({expected * dtype.itemsize:,} bytes): the file is truncated or from another "
            "preparation; prepare the dataset again"
        )
    return np.memmap(file, dtype=dtype, mode="r")


class Batches:
    """Random windows of block_size + 1 tokens from a dataset folder, as (inputs, targets) on
    device; from a dataset of examples (meta's example_tokens), random whole examples, their targets
    -1 (ignored by the loss) where the mask says the token is not one to learn. The batch of
    (iteration, micro-step) depends on the seed alone, so a run draws the same data with any number
    of DDP ranks, and again when resumed."""

    def __init__(
        self, path: Path, block_size: int, batch_size: int, seed: int, device: str
    ) -> None:
        self.path = path
        self.block_size = block_size
        self.batch_size = batch_size
        self.seed = seed
        self.device = device
        self.meta = load_meta(path)
        self.example = self.meta.get("example_tokens")
        if self.example and block_size + 1 != self.example:
            raise UserError(
                f"{path} holds examples of {self.example} tokens, each a row of its own: train "
                f"with block_size={self.example - 1} (block_size={block_size} was given)"
            )
        # each split's file as this run first read it: another preparation replaces the file
        self.stamps = {}
        self.splits = splits_of(self.meta)
        for split in self.splits:
            n = len(open_tokens(path, split, self.meta))
            if n <= block_size:
                raise UserError(
                    f"the {split} split of {path} has {n} tokens, fewer than block_size+1="
                    f"{block_size + 1}; lower block_size or use more data"
                )
            self.stamps[split] = stamp(path / f"{split}.bin")
            if self.example:
                open_tokens(path, split, self.meta, mask=True)  # there, and as long as the tokens

    def get(self, split: str, *key: int) -> tuple[torch.Tensor, torch.Tensor]:
        file = self.path / f"{split}.bin"
        if stamp(file) != self.stamps[split]:
            raise UserError(
                f"{file} was replaced while this run read it (the dataset was prepared again): its "
                f"tokens are no longer the ones the run started on; resume it on the new data "
                f"(--init_from=resume) or restart it"
            )
        # a fresh memmap each time avoids a slow memory build-up
        data = open_tokens(self.path, split, self.meta)
        rng = np.random.default_rng([self.seed, *key])
        T = self.block_size
        if self.example:  # whole examples, their first tokens at multiples of T + 1
            ix = rng.integers(0, len(data) // (T + 1), size=self.batch_size) * (T + 1)
        else:
            ix = rng.integers(0, len(data) - T, size=self.batch_size)
        ids = np.stack([data[i : i + T + 1] for i in ix])  # (B, T + 1)
        top = int(ids.max())
        if top >= self.meta["vocab_size"]:  # an embedding lookup would fail with no file named
            raise UserError(
                f"{file} holds token id {top}, beyond the vocab_size {self.meta['vocab_size']} of "
                "its meta.json: the file is damaged or from another tokenizer; prepare the dataset "
                "again"
            )
        buf = torch.from_numpy(ids.astype(np.int64))
        if self.example:  # targets the mask leaves out: -1, which the loss ignores
            mask = open_tokens(self.path, split, self.meta, mask=True)
            learn = torch.from_numpy(np.stack([mask[i : i + T + 1] for i in ix]).astype(bool))
            buf = torch.cat([buf[:, :-1], torch.where(learn, buf, -1)[:, 1:]], dim=1)
        if self.device.startswith("cuda"):
            buf = buf.pin_memory().to(self.device, non_blocking=True)
        if self.example:
            return buf[:, :T], buf[:, T:]
        return buf[:, :-1], buf[:, 1:]

    def train(self, it: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get("train", 0, it, micro)

    def eval(self, split: str, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k-th eval batch of split: the same at every eval."""
        return self.get(split, 1, ("train", "val", "test").index(split), k)

    @property
    def held_out(self) -> str:
        """The split a run's final figures are measured on: test where the dataset has one, else
        val."""
        return self.splits[-1]


def stamp(file: Path) -> tuple[int, int, int]:
    """What tells one version of a file from the next: its inode, size and modification time."""
    st = file.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


def split_ids(
    ids: np.ndarray, val_fraction: float = 0.05, test_fraction: float = 0.05
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """ids cut into train, val and test, in that order (test None at test_fraction 0): the last
    tenth held out by default, as nanoGPT's val, in two halves."""
    n_train = int(len(ids) * (1 - (val_fraction + test_fraction)))  # 0.05 + 0.05: nanoGPT's 0.9
    n_val = n_train + int(len(ids) * val_fraction) if test_fraction else len(ids)
    fractions = f"val_fraction={val_fraction}, test_fraction={test_fraction}"
    if not (0 < val_fraction < 1 and 0 <= test_fraction < 1 and val_fraction + test_fraction < 1):
        raise UserError(
            f"{fractions}: val_fraction must be in (0, 1), test_fraction in [0, 1), their sum "
            "below 1"
        )
    if not 0 < n_train < n_val <= len(ids) or (test_fraction and n_val == len(ids)):
        raise UserError(
            f"{len(ids)} tokens at {fractions} leave a split empty: the text must be long enough "
            "for each"
        )
    return ids[:n_train], ids[n_train:n_val], ids[n_val:] if test_fraction else None


def read_text(path: str, what: str = "input file") -> str:
    """A UTF-8 text file's contents, or one line saying why not."""
    if not Path(path).is_file():
        why = "is not a file" if Path(path).exists() else "not found"
        raise UserError(f"{what} {path} {why}")
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{what} {path} is not UTF-8 text ({e.reason} at byte {e.start})") from e


def download_text(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.read().decode("utf-8")
    except OSError as e:  # URLError, timeouts and refused connections are all OSErrors
        raise UserError(
            f"cannot download {url} ({getattr(e, 'reason', e)}); with no network, pass a local "
            "copy as --input=FILE"
        ) from e


def prepare_text(
    text: str,
    out_dir: Path,
    tokenizer: str = "char",
    val_fraction: float = 0.05,
    vocab_size: int | None = None,
    test_fraction: float = 0.05,
    settings: dict | None = None,
) -> None:
    """Tokenise one text (char-level, GPT-2 BPE, or a BPE of vocab_size trained on it) and write it
    as a dataset with train, val and (test_fraction above 0) test splits, recording settings (the
    preparation's: settings_of)."""
    if not text:
        raise UserError("the text is empty: nothing to make a dataset of")
    if vocab_size is not None and tokenizer != "bpe":
        raise UserError(
            f"vocab_size is for tokenizer='bpe'; a {tokenizer} dataset's vocabulary is fixed"
        )
    if tokenizer == "char":
        tok = CharTokenizer.from_text(text)
        ids = tok.encode_array(text)
        meta = tok.meta()
    elif tokenizer == "gpt2":
        enc = gpt2_encoding()
        ids = np.array(enc.encode_ordinary(text), dtype=np.int64)
        meta = {"tokenizer": "gpt2", "vocab_size": enc.n_vocab}
    elif tokenizer == "bpe":
        if vocab_size is None:
            raise UserError("tokenizer='bpe' needs --vocab_size=N, the number of tokens to train")
        tok = train_bpe(text, vocab_size)
        if tok.n_vocab < vocab_size:  # BPE stops when no pair of tokens is left to merge
            print(
                f"note: the text allows only {tok.n_vocab:,} BPE tokens, not the {vocab_size:,} "
                f"asked for: the dataset's vocab_size is {tok.n_vocab:,} (more text makes more "
                "merges possible)"
            )
        ids = tok.encode_array(text)
        meta = {"tokenizer": "bpe", "vocab_size": tok.n_vocab, "bpe": tok.tok.to_str()}
    else:
        raise UserError(f"unknown tokenizer {tokenizer!r}: use 'char', 'gpt2' or 'bpe'")

    train_ids, val_ids, test_ids = split_ids(ids, val_fraction, test_fraction)
    write_dataset(out_dir, train_ids, val_ids, meta, test_ids, settings)
