"""Tokenizers: a dataset's characters, GPT-2's BPE (tiktoken), or a byte-level BPE trained on the
text (Hugging Face tokenizers), all with the interface sample.py uses of tiktoken's (encode, decode,
decode_bytes, eot_token, n_vocab); and the tokenizer a dataset's meta, or a Hugging Face folder,
names.
"""

import base64
import json
import os
import re
import sys
import unicodedata
from pathlib import Path

import numpy as np

from smallgpt.errors import UserError, first_line

# a 'bpe' dataset's tokenizer, beside its meta.json; an exported folder's
BPE_FILE = "tokenizer.json"
EOT = "<|endoftext|>"
# a local gpt2.tiktoken (r50k_base) file, for machines with no network
GPT2_BPE_ENV = "GPT2_BPE_FILE"


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
        """The ids of text's characters; text written in the other Unicode normal form (a composed é
        against the dataset's e and accent, or the reverse) is taken in the one the dataset has."""
        forms = [text, *(unicodedata.normalize(f, text) for f in ("NFC", "NFD"))]
        known = [t for t in forms if set(t) <= self.stoi.keys()]
        if not known:
            unknown = sorted(set(text) - self.stoi.keys())
            listed = ", ".join(f"{c!r} (U+{ord(c):04X})" for c in unknown)
            raise UserError(f"characters not in the dataset's vocabulary: {listed}")
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

    def decode_bytes(self, ids: list[int]) -> bytes:
        """The bytes of ids' text, as tiktoken's, for incremental (streamed) decoding."""
        return self.decode(ids).encode()

    def meta(self) -> dict:
        return {"tokenizer": "char", "vocab_size": len(self.chars), "chars": self.chars}


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer (a 'bpe' dataset's, or an exported folder's
    tokenizer.json) with the interface sample.py uses of tiktoken's: encode, decode, decode_bytes,
    eot_token, n_vocab."""

    def __init__(self, tokenizer_json: str, source: str = "the dataset's tokenizer.json") -> None:
        from tokenizers import Tokenizer

        try:
            self.tok = Tokenizer.from_str(tokenizer_json)
        except Exception as e:  # tokenizers raises a bare Exception for a file it cannot read
            raise UserError(
                f"{source} is damaged or not a tokenizers file ({first_line(e)}): prepare the "
                "dataset again, or export the model again"
            ) from e
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
        # tokenizers raises a plain Exception: export.py's char-level one for a character it lacks
        except Exception:
            ids = []
            back = "".join(c for c in text if self.tok.token_to_id(c) is not None)
        if back != text:  # older exports mapped what they lack to a real token
            raise UserError(
                "characters not in the tokenizer's vocabulary: "
                f"{''.join(sorted(set(text) - set(back)))!r}"
            )
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def decode_bytes(self, ids: list[int]) -> bytes:
        """The bytes of ids' text: a token can end inside a character (streamed decoding)."""
        if not self.byte_level:
            return self.decode(ids).encode()
        pieces = (self.tok.id_to_token(i) for i in ids)
        return b"".join(
            p.encode() if p == EOT else bytes(self.char_byte[c] for c in p) for p in pieces
        )

    def encode_array(self, text: str, piece_chars: int = 1 << 20) -> np.ndarray:
        """encode() for long texts, with a progress bar: pieces of about piece_chars encoded in
        parallel, each cut where a space sits between two ASCII letters, so the ids equal
        encode(text)'s (no pre-token spans a cut)."""
        from tqdm import tqdm

        cut = re.compile(r"(?<=[A-Za-z]) (?=[A-Za-z])")
        pieces = []
        pos = 0
        while pos < len(text):
            m = cut.search(text, pos + piece_chars)
            pieces.append(text[pos : m.start() if m else len(text)])
            pos += len(pieces[-1])
        ids = []
        quiet = len(pieces) < 8
        bar = tqdm(total=len(text), desc="encoding", unit="char", unit_scale=True, disable=quiet)
        with bar:
            for i in range(0, len(pieces), 8):
                batch = pieces[i : i + 8]
                encoded = self.tok.encode_batch(batch, add_special_tokens=False)
                ids += [np.array(e.ids, dtype=np.int64) for e in encoded]
                bar.update(sum(map(len, batch)))
        return np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)


def train_bpe(text: str, vocab_size: int) -> HFTokenizer:
    """A byte-level BPE (GPT-2's pre-tokenizer and byte alphabet, <|endoftext|> as its one special
    token) of vocab_size tokens, trained on text by Hugging Face tokenizers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if not len(alphabet) + 1 < vocab_size <= 2**32:
        raise UserError(
            f"vocab_size={vocab_size} for a byte-level BPE must be above {len(alphabet) + 1} (the "
            f"256 bytes and {EOT})"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=alphabet,
        show_progress=len(text) > 1 << 20,
    )
    step = 1 << 16
    tok.train_from_iterator(
        (text[i : i + step] for i in range(0, len(text), step)),
        trainer=trainer,
        length=-(-len(text) // step),
    )
    return HFTokenizer(tok.to_str())


def gpt2_encoding(bpe_file: str | None = None) -> "object":
    """tiktoken's GPT-2 BPE: from bpe_file (or $GPT2_BPE_FILE) if given, else tiktoken's cache or
    download."""
    import tiktoken

    bpe_file = bpe_file or os.environ.get(GPT2_BPE_ENV)
    if bpe_file:
        from tiktoken_ext.openai_public import r50k_pat_str

        try:  # one base64 token and its rank per line, as in r50k_base.tiktoken
            lines = Path(bpe_file).read_text().split("\n")
            pairs = (ln.split() for ln in lines if ln)
            ranks = {base64.b64decode(tok): int(rank) for tok, rank in pairs}
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read GPT-2 BPE file {bpe_file}: {e}") from e
        return tiktoken.Encoding(
            name="gpt2",
            pat_str=r50k_pat_str,
            mergeable_ranks=ranks,
            special_tokens={"<|endoftext|>": len(ranks)},
        )
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # tiktoken raises requests' errors (or others) when it cannot download
        raise UserError(
            f"cannot load the GPT-2 BPE ({type(e).__name__}): tiktoken downloads it on first use. "
            "Run once with network, point TIKTOKEN_CACHE_DIR at a cache that has it, or set "
            f"{GPT2_BPE_ENV} to a local gpt2.tiktoken file"
        ) from e


def load_tokenizer(meta: dict) -> "CharTokenizer | object":
    """The tokenizer a dataset was made with: encode(str) -> ids, decode(ids) -> str, eot_token (or
    None)."""
    if meta.get("tokenizer") == "char":
        return CharTokenizer(meta["chars"])
    if meta.get("tokenizer") == "gpt2":
        return gpt2_encoding()
    if meta.get("tokenizer") == "bpe":
        return HFTokenizer(meta["bpe"])
    raise UserError(
        f"unknown tokenizer {meta.get('tokenizer')!r} in meta.json (expected 'char', 'gpt2' or "
        "'bpe')"
    )


def encode_prompt(tok: "CharTokenizer | HFTokenizer | object", text: str) -> list[int]:
    """A prompt's ids: <|endoftext|> written in it is the end-of-text token, as nanoGPT's sample.py
    reads it (a dataset's text takes it as plain characters)."""
    # tiktoken refuses special tokens unless allowed
    special = getattr(tok, "special_tokens_set", None)
    if special is None:
        return tok.encode(text)
    return tok.encode(text, allowed_special=special)


def folder_tokenizer(name_or_path: str) -> "HFTokenizer | object":
    """The tokenizer of a Hugging Face model folder (its tokenizer.json, as export.py writes);
    GPT-2's BPE for a hub name, or for a GPT-2 folder without one whose embeddings hold GPT-2's
    tokens (said on stderr)."""
    folder = Path(name_or_path)
    if (folder / BPE_FILE).is_file():
        return HFTokenizer((folder / BPE_FILE).read_text(), str(folder / BPE_FILE))
    if not folder.is_dir():  # a hub name ('gpt2', ...)
        return gpt2_encoding()
    vocab_size = gpt2_folder_vocab(folder)
    enc = gpt2_encoding()
    if vocab_size < enc.n_vocab:
        raise UserError(
            f"{folder} has no {BPE_FILE}, and its GPT-2 model's vocab_size={vocab_size} is below "
            f"GPT-2's {enc.n_vocab} tokens: save the model's tokenizer there "
            "(tokenizer.save_pretrained)"
        )
    print(
        f"note: {folder} has no {BPE_FILE}: its text is read as GPT-2's BPE, as its config.json is "
        f"a GPT-2 model's (model_type gpt2, vocab_size {vocab_size})",
        file=sys.stderr,
    )
    return enc


def gpt2_folder_vocab(folder: Path) -> int:
    """The vocab_size of a folder without tokenizer.json whose config.json is a GPT-2 model's
    (GPT-2's BPE then reads its text); any other such folder is refused in one line, never read as
    GPT-2's BPE."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        config = None
    config = config if isinstance(config, dict) else {}
    if config.get("model_type") != "gpt2" or not isinstance(config.get("vocab_size"), int):
        raise UserError(
            f"{folder} has no {BPE_FILE} (the tokenizer), and its config.json is not a GPT-2 "
            f"model's (model_type {config.get('model_type')!r}), which GPT-2's BPE would read: "
            "save the model's tokenizer there (tokenizer.save_pretrained), or export the run again "
            "with export.py"
        )
    return config["vocab_size"]
