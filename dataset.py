"""Token datasets on disk, as nanoGPT lays them out: data/<name>/{train,val}.bin (flat token ids) + meta.json,
and the training batches drawn from them.

meta.json (JSON, not pickle, so loading a dataset cannot run code) holds the token dtype, vocab_size and the
tokenizer: 'char' with its character list, 'gpt2' (tiktoken BPE), or 'bpe' (a byte-level BPE trained on the text by
Hugging Face tokenizers, kept beside it as tokenizer.json). Run as a script it turns any local text file into such a
dataset: `python dataset.py --input=notes.txt --out_dir=data/notes --tokenizer=char` (or gpt2, or bpe with
--vocab_size=N).
"""

# configurator first: a Ctrl-C while torch imports is then one line, not a traceback
from configurator import UserError, first_line, run_cli

# isort: split
import base64
import json
import os
import re
import sys
import unicodedata
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from atomic import atomic_open, check_writes_into

DATA_ROOT = Path(__file__).resolve().parent / "data"
GPT2_BPE_ENV = "GPT2_BPE_FILE"  # a local gpt2.tiktoken (r50k_base) file, for machines with no network
BPE_FILE = "tokenizer.json"  # a 'bpe' dataset's tokenizer, beside its meta.json
EOT = "<|endoftext|>"


def data_dir(dataset: str) -> Path:
    """A dataset name (a folder under data/) or a path to a dataset folder."""
    return Path(dataset) if os.sep in dataset or dataset.startswith(".") else DATA_ROOT / dataset


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


@contextmanager
def writing_dataset(out_dir: Path, names: tuple[str, ...] = ("train.bin", "val.bin")) -> Iterator[tuple[dict, dict]]:
    """Write a dataset folder: the block writes the named files ({name: binary temp file}) and fills the meta dict;
    then meta.json is removed, the files are renamed into place and meta.json is written, last. A failure in the block
    leaves a dataset in out_dir as it was; a folder without meta.json is never taken as complete (load_meta)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"out_dir {out_dir} is a file, not a folder: choose another --out_dir")
    check_writes_into(out_dir, "a dataset", (*names, "meta.json"))  # e.g. not into a run or an export
    out_dir.mkdir(parents=True, exist_ok=True)
    meta: dict = {}
    with ExitStack() as stack:  # the temp files are renamed when it closes, after meta.json is gone
        yield {name: stack.enter_context(atomic_open(out_dir / name)) for name in names}, meta
        (out_dir / "meta.json").unlink(missing_ok=True)
    with atomic_open(out_dir / "meta.json", "w") as f:
        json.dump(meta, f, indent=1)


def write_dataset(out_dir: Path, train_ids: np.ndarray, val_ids: np.ndarray, meta: dict) -> None:
    """Write train.bin, val.bin (and a 'bpe' meta's tokenizer.json), then meta.json (writing_dataset)."""
    dtype, bpe = token_dtype(meta["vocab_size"]), meta.get("bpe")
    with writing_dataset(out_dir, ("train.bin", "val.bin") + (BPE_FILE,) * (bpe is not None)) as (files, written):
        if bpe is not None:
            files[BPE_FILE].write(bpe.encode())
        for split, ids in (("train", train_ids), ("val", val_ids)):
            files[f"{split}.bin"].write(np.asarray(ids, dtype=dtype).tobytes())
        written.update({k: v for k, v in meta.items() if k != "bpe"}, dtype=dtype.name,
                       train_tokens=int(len(train_ids)), val_tokens=int(len(val_ids)))
    print(f"wrote {out_dir}: {len(train_ids):,} train and {len(val_ids):,} val tokens, vocab_size {meta['vocab_size']}")


def load_meta(path: Path) -> dict:
    file = path / "meta.json"
    if not file.is_file():
        hint = (f"run python data/{path.name}/prepare.py first" if (DATA_ROOT / path.name / "prepare.py").is_file()
                else "prepare it first (python dataset.py --help)")
        raise UserError(f"no dataset at {path} (missing meta.json): {hint}")
    try:
        meta = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{file} is not valid JSON ({e}); prepare the dataset again") from e
    if problems := meta_problems(meta):
        raise UserError(f"{file} is damaged or not a dataset's meta ({'; '.join(problems)}): prepare the dataset again")
    if meta.get("tokenizer") == "bpe":  # the tokenizer travels with the meta (into checkpoints, to export.py)
        if not (path / BPE_FILE).is_file():
            raise UserError(f"{path / BPE_FILE} is missing (the dataset's BPE tokenizer); prepare the dataset again")
        meta["bpe"] = (path / BPE_FILE).read_text(encoding="utf-8")
    return meta


def meta_problems(meta: object) -> list[str]:
    """What is missing or wrong in a dataset's meta.json: the fields that reading its tokens relies on."""
    if not isinstance(meta, dict):
        return ["not a JSON object"]
    counts = ("vocab_size", "train_tokens", "val_tokens")
    problems = [f"{k} is {meta.get(k)!r}, not a whole number" for k in counts
                if not isinstance(meta.get(k), int) or isinstance(meta.get(k), bool) or meta[k] < 0]
    if meta.get("dtype") not in ("uint16", "uint32"):
        problems.append(f"dtype is {meta.get('dtype')!r}, not uint16 or uint32")
    elif isinstance(meta.get("vocab_size"), int) and meta["vocab_size"] > np.iinfo(meta["dtype"]).max + 1:
        problems.append(f"vocab_size {meta['vocab_size']} does not fit {meta['dtype']}")
    if meta.get("tokenizer") not in ("char", "gpt2", "bpe"):
        problems.append(f"tokenizer is {meta.get('tokenizer')!r}, not char, gpt2 or bpe")
    elif meta["tokenizer"] == "char":
        chars = meta.get("chars")
        if not isinstance(chars, list) or not all(isinstance(c, str) and len(c) == 1 for c in chars):
            problems.append("a char dataset without its list of characters")
        elif len(set(chars)) != len(chars) or len(chars) != meta.get("vocab_size"):
            problems.append(f"{len(chars)} characters ({len(set(chars))} distinct) for vocab_size "
                            f"{meta.get('vocab_size')}")
    return problems


def vocab_size_of(dataset: str) -> int | None:
    """The dataset's vocab_size if it has been prepared, else None."""
    return load_meta(data_dir(dataset))["vocab_size"] if (data_dir(dataset) / "meta.json").is_file() else None


def open_tokens(path: Path, split: str, meta: dict) -> np.memmap:
    """The split's token ids as a read-only memmap, after checking the file against meta.json."""
    file = path / f"{split}.bin"
    if not file.is_file():
        raise UserError(f"{file} is missing; prepare the dataset again")
    dtype = np.dtype(meta["dtype"])
    size = file.stat().st_size
    expected = meta[f"{split}_tokens"]
    if size != expected * dtype.itemsize:
        raise UserError(f"{file} has {size:,} bytes, but meta.json says {expected:,} tokens of {dtype.name} "
                        f"({expected * dtype.itemsize:,} bytes): the file is truncated or from another preparation; "
                        f"prepare the dataset again")
    return np.memmap(file, dtype=dtype, mode="r")


class Batches:
    """Random windows of block_size + 1 tokens from a dataset folder, as (inputs, targets) on device. The batch of
    (iteration, micro-step) depends on the seed alone, so a run draws the same data with any number of DDP ranks,
    and again when resumed."""

    def __init__(self, path: Path, block_size: int, batch_size: int, seed: int, device: str) -> None:
        self.path, self.block_size, self.batch_size, self.seed, self.device = path, block_size, batch_size, seed, device
        self.meta = load_meta(path)
        self.stamps = {}  # each split's file as this run first read it: another preparation replaces the file
        for split in ("train", "val"):
            n = len(open_tokens(path, split, self.meta))
            if n <= block_size:
                raise UserError(f"the {split} split of {path} has {n} tokens, fewer than block_size+1="
                                f"{block_size + 1}; lower block_size or use more data")
            self.stamps[split] = stamp(path / f"{split}.bin")

    def get(self, split: str, *key: int) -> tuple[torch.Tensor, torch.Tensor]:
        file = self.path / f"{split}.bin"
        if stamp(file) != self.stamps[split]:
            raise UserError(f"{file} was replaced while this run read it (the dataset was prepared again): its "
                            f"tokens are no longer the ones the run started on; resume it on the new data "
                            f"(--init_from=resume) or restart it")
        data = open_tokens(self.path, split, self.meta)  # a fresh memmap each time avoids a slow memory build-up
        rng = np.random.default_rng([self.seed, *key])
        T = self.block_size
        ix = rng.integers(0, len(data) - T, size=self.batch_size)
        ids = np.stack([data[i:i + T + 1] for i in ix])  # (B, T + 1)
        if (top := int(ids.max())) >= self.meta["vocab_size"]:  # an embedding lookup would fail with no file named
            raise UserError(f"{file} holds token id {top}, beyond the vocab_size {self.meta['vocab_size']} of its "
                            f"meta.json: the file is damaged or from another tokenizer; prepare the dataset again")
        buf = torch.from_numpy(ids.astype(np.int64))
        if self.device.startswith("cuda"):
            buf = buf.pin_memory().to(self.device, non_blocking=True)
        return buf[:, :-1], buf[:, 1:]

    def train(self, it: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get("train", 0, it, micro)

    def eval(self, split: str, k: int) -> tuple[torch.Tensor, torch.Tensor]:  # the same batches at every eval
        return self.get(split, 1, ("train", "val").index(split), k)


def stamp(file: Path) -> tuple[int, int, int]:
    """What tells one version of a file from the next: its inode, size and modification time."""
    st = file.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


def split_ids(ids: np.ndarray, val_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    n = int(len(ids) * (1 - val_fraction))
    if not 0 < val_fraction < 1 or not 0 < n < len(ids):
        raise UserError(f"{len(ids)} tokens at val_fraction={val_fraction} leave a split empty: val_fraction must be "
                        f"in (0, 1), and the text long enough for both")
    return ids[:n], ids[n:]


def read_text(path: str, what: str = "input file") -> str:
    """A UTF-8 text file's contents, or one line saying why not."""
    if not Path(path).is_file():
        raise UserError(f"{what} {path} {'is not a file' if Path(path).exists() else 'not found'}")
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{what} {path} is not UTF-8 text ({e.reason} at byte {e.start})") from e


class CharTokenizer:
    """Characters to ids by their index in a fixed character list."""

    def __init__(self, chars: list[str]) -> None:
        self.chars = chars
        self.stoi = {c: i for i, c in enumerate(chars)}
        self.eot_token = None  # as tiktoken's Encoding: char datasets have no end-of-text token
        self.n_vocab = len(chars)

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls(sorted(set(text)))

    def encode(self, text: str) -> list[int]:
        """The ids of text's characters; text written in the other Unicode normal form (a composed é against the
        dataset's e and accent, or the reverse) is taken in the one the dataset has."""
        forms = [text, *(unicodedata.normalize(f, text) for f in ("NFC", "NFD"))]
        if not (known := [t for t in forms if set(t) <= self.stoi.keys()]):
            unknown = sorted(set(text) - self.stoi.keys())
            raise UserError(f"characters not in the dataset's vocabulary: "
                            f"{', '.join(f'{c!r} (U+{ord(c):04X})' for c in unknown)}")
        return [self.stoi[c] for c in known[0]]

    def encode_array(self, text: str) -> np.ndarray:
        """encode() for long texts: a lookup table over code points instead of a Python loop."""
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        table = np.full(max(map(ord, self.chars)) + 1, -1, dtype=np.int64)
        table[[ord(c) for c in self.chars]] = np.arange(len(self.chars))
        ids = table[np.minimum(codes, len(table) - 1)]
        if (ids < 0).any() or (codes >= len(table)).any():
            self.encode(text)  # raises with the unknown characters listed
        return ids

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def decode_bytes(self, ids: list[int]) -> bytes:  # as tiktoken's, for incremental (streamed) decoding
        return self.decode(ids).encode()

    def meta(self) -> dict:
        return {"tokenizer": "char", "vocab_size": len(self.chars), "chars": self.chars}


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer (a 'bpe' dataset's, or an exported folder's tokenizer.json) with the
    interface sample.py uses of tiktoken's: encode, decode, decode_bytes, eot_token, n_vocab."""

    def __init__(self, tokenizer_json: str, source: str = "the dataset's tokenizer.json") -> None:
        from tokenizers import Tokenizer

        try:
            self.tok = Tokenizer.from_str(tokenizer_json)
        except Exception as e:  # tokenizers raises a bare Exception for a file it cannot read
            raise UserError(f"{source} is damaged or not a tokenizers file ({first_line(e)}): prepare the dataset "
                            f"again, or export the model again") from e
        self.eot_token = self.tok.token_to_id(EOT)
        self.n_vocab = self.tok.get_vocab_size()
        self.byte_level = type(self.tok.decoder).__name__ == "ByteLevel"
        if self.byte_level:  # each token's characters stand for bytes (GPT-2's table)
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            self.char_byte = {c: b for b, c in bytes_to_unicode().items()}

    def encode(self, text: str) -> list[int]:
        try:
            ids = self.tok.encode(text, add_special_tokens=False).ids
            back = self.decode(ids)
        except Exception:  # tokenizers raises a plain Exception: export.py's char-level one for a character it lacks
            ids, back = [], "".join(c for c in text if self.tok.token_to_id(c) is not None)
        if back != text:  # older exports mapped what they lack to a real token
            raise UserError(f"characters not in the tokenizer's vocabulary: {''.join(sorted(set(text) - set(back)))!r}")
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def decode_bytes(self, ids: list[int]) -> bytes:  # a token can end inside a character (streamed decoding)
        if not self.byte_level:
            return self.decode(ids).encode()
        pieces = (self.tok.id_to_token(i) for i in ids)
        return b"".join(p.encode() if p == EOT else bytes(self.char_byte[c] for c in p) for p in pieces)

    def encode_array(self, text: str, piece_chars: int = 1 << 20) -> np.ndarray:
        """encode() for long texts, with a progress bar: pieces of about piece_chars encoded in parallel, each cut
        where a space sits between two ASCII letters, so the ids equal encode(text)'s (no pre-token spans a cut)."""
        from tqdm import tqdm

        cut, pieces, pos = re.compile(r"(?<=[A-Za-z]) (?=[A-Za-z])"), [], 0
        while pos < len(text):
            m = cut.search(text, pos + piece_chars)
            pieces.append(text[pos:m.start() if m else len(text)])
            pos += len(pieces[-1])
        ids = []
        with tqdm(total=len(text), desc="encoding", unit="char", unit_scale=True, disable=len(pieces) < 8) as bar:
            for i in range(0, len(pieces), 8):
                batch = pieces[i:i + 8]
                ids += [np.array(e.ids, dtype=np.int64) for e in self.tok.encode_batch(batch, add_special_tokens=False)]
                bar.update(sum(map(len, batch)))
        return np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)


def train_bpe(text: str, vocab_size: int) -> HFTokenizer:
    """A byte-level BPE (GPT-2's pre-tokenizer and byte alphabet, <|endoftext|> as its one special token) of
    vocab_size tokens, trained on text by Hugging Face tokenizers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if not len(alphabet) + 1 < vocab_size <= 2**32:
        raise UserError(f"vocab_size={vocab_size} for a byte-level BPE must be above {len(alphabet) + 1} (the 256 "
                        f"bytes and {EOT})")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], initial_alphabet=alphabet,
                                  show_progress=len(text) > 1 << 20)
    step = 1 << 16
    tok.train_from_iterator((text[i:i + step] for i in range(0, len(text), step)), trainer=trainer,
                            length=-(-len(text) // step))
    return HFTokenizer(tok.to_str())


def download_text(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.read().decode("utf-8")
    except OSError as e:  # URLError, timeouts and refused connections are all OSErrors
        raise UserError(f"cannot download {url} ({getattr(e, 'reason', e)}); with no network, pass a local copy "
                        f"as --input=FILE") from e


def gpt2_encoding(bpe_file: str | None = None) -> "object":
    """tiktoken's GPT-2 BPE: from bpe_file (or $GPT2_BPE_FILE) if given, else tiktoken's cache or download."""
    import tiktoken

    bpe_file = bpe_file or os.environ.get(GPT2_BPE_ENV)
    if bpe_file:
        from tiktoken_ext.openai_public import r50k_pat_str

        try:  # one base64 token and its rank per line, as in r50k_base.tiktoken
            lines = Path(bpe_file).read_text().split("\n")
            ranks = {base64.b64decode(tok): int(rank) for tok, rank in (ln.split() for ln in lines if ln)}
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read GPT-2 BPE file {bpe_file}: {e}") from e
        return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                 special_tokens={"<|endoftext|>": len(ranks)})
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # tiktoken raises requests' errors (or others) when it cannot download
        raise UserError(f"cannot load the GPT-2 BPE ({type(e).__name__}): tiktoken downloads it on first use. Run "
                        f"once with network, point TIKTOKEN_CACHE_DIR at a cache that has it, or set "
                        f"{GPT2_BPE_ENV} to a local gpt2.tiktoken file") from e


def load_tokenizer(meta: dict) -> "CharTokenizer | object":
    """The tokenizer a dataset was made with: encode(str) -> ids, decode(ids) -> str, eot_token (or None)."""
    if meta.get("tokenizer") == "char":
        return CharTokenizer(meta["chars"])
    if meta.get("tokenizer") == "gpt2":
        return gpt2_encoding()
    if meta.get("tokenizer") == "bpe":
        return HFTokenizer(meta["bpe"])
    raise UserError(f"unknown tokenizer {meta.get('tokenizer')!r} in meta.json (expected 'char', 'gpt2' or 'bpe')")


def encode_prompt(tok: "CharTokenizer | HFTokenizer | object", text: str) -> list[int]:
    """A prompt's ids: <|endoftext|> written in it is the end-of-text token, as nanoGPT's sample.py reads it (a
    dataset's text takes it as plain characters)."""
    special = getattr(tok, "special_tokens_set", None)  # tiktoken refuses special tokens unless allowed
    return tok.encode(text, allowed_special=special) if special is not None else tok.encode(text)


def folder_tokenizer(name_or_path: str) -> "HFTokenizer | object":
    """The tokenizer of a Hugging Face model folder (its tokenizer.json, as export.py writes); GPT-2's BPE for a hub
    name, or for a GPT-2 folder without one whose embeddings hold GPT-2's tokens (said on stderr)."""
    folder = Path(name_or_path)
    if (folder / BPE_FILE).is_file():
        return HFTokenizer((folder / BPE_FILE).read_text(), str(folder / BPE_FILE))
    if not folder.is_dir():  # a hub name ('gpt2', ...)
        return gpt2_encoding()
    vocab_size, enc = gpt2_folder_vocab(folder), gpt2_encoding()
    if vocab_size < enc.n_vocab:
        raise UserError(f"{folder} has no {BPE_FILE}, and its GPT-2 model's vocab_size={vocab_size} is below GPT-2's "
                        f"{enc.n_vocab} tokens: save the model's tokenizer there (tokenizer.save_pretrained)")
    print(f"note: {folder} has no {BPE_FILE}: its text is read as GPT-2's BPE, as its config.json is a GPT-2 "
          f"model's (model_type gpt2, vocab_size {vocab_size})", file=sys.stderr)
    return enc


def gpt2_folder_vocab(folder: Path) -> int:
    """The vocab_size of a folder without tokenizer.json whose config.json is a GPT-2 model's (GPT-2's BPE then reads
    its text); any other such folder is refused in one line, never read as GPT-2's BPE."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        config = None
    config = config if isinstance(config, dict) else {}
    if config.get("model_type") != "gpt2" or not isinstance(config.get("vocab_size"), int):
        raise UserError(f"{folder} has no {BPE_FILE} (the tokenizer), and its config.json is not a GPT-2 model's "
                        f"(model_type {config.get('model_type')!r}), which GPT-2's BPE would read: save the model's "
                        f"tokenizer there (tokenizer.save_pretrained), or export the run again with export.py")
    return config["vocab_size"]


def prepare_text(text: str, out_dir: Path, tokenizer: str = "char", val_fraction: float = 0.1,
                 vocab_size: int | None = None) -> None:
    """Tokenise one text (char-level, GPT-2 BPE, or a BPE of vocab_size trained on it) and write it as a dataset
    with a train/val split."""
    if not text:
        raise UserError("the text is empty: nothing to make a dataset of")
    if vocab_size is not None and tokenizer != "bpe":
        raise UserError(f"vocab_size is for tokenizer='bpe'; a {tokenizer} dataset's vocabulary is fixed")
    if tokenizer == "char":
        tok = CharTokenizer.from_text(text)
        ids, meta = tok.encode_array(text), tok.meta()
    elif tokenizer == "gpt2":
        enc = gpt2_encoding()
        ids = np.array(enc.encode_ordinary(text), dtype=np.int64)
        meta = {"tokenizer": "gpt2", "vocab_size": enc.n_vocab}
    elif tokenizer == "bpe":
        if vocab_size is None:
            raise UserError("tokenizer='bpe' needs --vocab_size=N, the number of tokens to train")
        tok = train_bpe(text, vocab_size)
        if tok.n_vocab < vocab_size:  # BPE stops when no pair of tokens is left to merge
            print(f"note: the text allows only {tok.n_vocab:,} BPE tokens, not the {vocab_size:,} asked for: the "
                  f"dataset's vocab_size is {tok.n_vocab:,} (more text makes more merges possible)")
        ids, meta = tok.encode_array(text), {"tokenizer": "bpe", "vocab_size": tok.n_vocab, "bpe": tok.tok.to_str()}
    else:
        raise UserError(f"unknown tokenizer {tokenizer!r}: use 'char', 'gpt2' or 'bpe'")

    write_dataset(out_dir, *split_ids(ids, val_fraction), meta)


@dataclass(slots=True)
class TextConfig:
    input: str = ""  # a UTF-8 text file
    out_dir: str = ""  # the dataset folder to write, e.g. data/mytext
    tokenizer: str = "char"  # 'char', 'gpt2', or 'bpe' (a byte-level BPE trained on the input)
    vocab_size: int | None = None  # bpe: tokens to train, bytes and <|endoftext|> included
    val_fraction: float = 0.1


def main(cfg: TextConfig) -> None:
    if not cfg.input or not cfg.out_dir:
        raise UserError("usage: python dataset.py --input=FILE --out_dir=data/NAME [--tokenizer=char|gpt2|bpe "
                        "--vocab_size=N]")
    prepare_text(read_text(cfg.input), Path(cfg.out_dir), cfg.tokenizer, cfg.val_fraction, cfg.vocab_size)


if __name__ == "__main__":
    run_cli(main, TextConfig)
