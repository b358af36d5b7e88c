"""Export a trained model to a Hugging Face transformers folder, and from it to a GGUF file for
llama.cpp:

    python export.py --out_dir=out-pycode-char [--to=DIR] [--overwrite=True]
    python export.py --out_dir=OUT --gguf=model.gguf --llama_cpp=../llama.cpp [--gguf_type=f32]

DIR (default <out_dir>/hf; none with --gguf alone) then loads with transformers' own classes, no
code of ours: AutoModelForCausalLM.from_pretrained(DIR) and AutoTokenizer.from_pretrained(DIR). It
holds config.json, model.safetensors, generation_config.json, the dataset's tokenizer (char-level,
GPT-2's BPE or its own), a README.md model card and smallgpt.json, the marker of an export. Which
class holds which model: smallgpt/hf.py. The GGUF file is written by llama.cpp's own
convert_hf_to_gguf.py from such a folder (byte-level BPE tokenizers only: llama.cpp has no
char-level vocabulary). Each is written whole or not at all, under a lock on the folder it goes in.
--overwrite=True replaces only an earlier export (a folder holding smallgpt.json, a file starting as
a GGUF does), never a run, a dataset or other files.
"""

# configurator first: a Ctrl-C while torch imports is then one line, not a traceback
from configurator import run_cli
from smallgpt.errors import UserError

# isort: split
import dataclasses
import fcntl
import json
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model import GPT, GPTConfig
from smallgpt import hf
from smallgpt.atomic import (
    KIND_MARKERS,
    cannot_write,
    check_replaceable,
    remove_stale_temps,
    temp_path,
)
from smallgpt.checkpoint import Source, load_run, run_config
from smallgpt.gguf import GGUF_TYPES, check_gguf_vocabulary, to_gguf
from smallgpt.runlog import read_run

MARKER = KIND_MARKERS["an export"][0]  # smallgpt.json: what folder_kind recognises an export by
# What an export written before smallgpt.json listed its files may hold: transformers' and ours
OLD_EXPORT_FILES = re.compile(
    r"config\.json|generation_config\.json|model(-\d+-of-\d+)?\.safetensors"
    r"|model\.safetensors\.index\.json|tokenizer(_config)?\.json|special_tokens_map\.json"
    r"|chat_template\.jinja|vocab\.json|merges\.txt|README\.md"
)


@dataclass(slots=True)
class ExportConfig:
    out_dir: str = "out"  # the run to export: its ckpt.pt, and its dataset's tokenizer
    to: str = ""  # the folder to write; '': <out_dir>/hf
    # replace an earlier export (a folder holding smallgpt.json; a GGUF file): nothing else
    overwrite: bool = False
    # also write this GGUF file, by llama.cpp's converter (without --to, no folder is kept)
    gguf: str = ""
    llama_cpp: str = ""  # gguf: a llama.cpp source folder (its convert_hf_to_gguf.py and gguf-py)
    gguf_type: str = "f32"  # gguf: the converter's --outtype: f32, f16, bf16 or q8_0

    def __post_init__(self) -> None:
        if self.gguf_type not in GGUF_TYPES:
            raise ValueError(f"gguf_type={self.gguf_type!r} must be one of {', '.join(GGUF_TYPES)}")
        if bool(self.gguf) != bool(self.llama_cpp):
            raise ValueError(
                "--gguf=FILE and --llama_cpp=DIR go together: the file is made by llama.cpp's "
                "converter"
            )
        if self.gguf_type != "f32" and not self.gguf:  # a key that would change nothing
            raise ValueError(
                f"gguf_type={self.gguf_type!r} is read by the GGUF conversion, and gguf='' asks "
                "for none: leave gguf_type out, or give --gguf=FILE --llama_cpp=DIR"
            )


def model_card(model: GPT, hf_model: Any, run: dict, ckpt: dict) -> str:
    """README.md: what the model is, what it scored, how to load it."""
    c = model.config
    evals = run.get("evals") or []
    trained = "| trained | - |"
    if evals:
        trained = (
            f"| trained | {ckpt.get('iter_num', '?')} iterations; val loss "
            f"{evals[-1]['val_loss']:.4f} at iteration {evals[-1]['iter']} |"
        )
    dataset = run_config(ckpt).get("dataset", "?")
    tokenizer = ckpt.get("data_meta", {}).get("tokenizer", "?")
    lines = [
        f"# {Path(run.get('dir', 'model')).name}",
        "",
        "A GPT trained with smallgpt, exported to a stock transformers class (no remote code).",
        "",
        "| | |",
        "|---|---|",
        f"| class | `{type(hf_model).__name__}` |",
        f"| attention | {c.mixing} |",
        f"| shape | {c.n_layer} layers, {c.n_embd} wide, MLP {c.mlp_hidden}, block_size "
        f"{c.block_size}, {c.pos_encoding} positions |",
        f"| parameters | {model.num_params():,} |",
        f"| KV cache per token (fp32, as exported) | {hf_kv_bytes(c):,} bytes (this model: "
        f"{c.kv_cache_bytes(1, 1):,}) |",
        f"| dataset | {dataset} ({tokenizer} tokens, vocab {c.vocab_size}) |",
        trained,
    ]
    if c.pos_encoding == "learned" and c.attention_type == "GQA":
        lines += [
            "",
            f"GPT-2 has no GQA: each of the {c.n_kv_head} K/V heads is repeated for its group of "
            f"{c.n_head // c.n_kv_head} query heads. The logits are exact, but the cache is MHA's "
            "size.",
        ]
    if c.window is not None:
        lines += [
            "",
            f"Local layers {c.local_layers} of {c.n_layer} (window_pattern={c.layer_letters!r}) "
            f"attend over their last {c.window} tokens (the class's layer_types, "
            f"sliding_window={c.window}), so their cache stays at the window however long the "
            "text; the others see the whole context.",
        ]
    lines += [
        "",
        past_block_size(c),
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "model = AutoModelForCausalLM.from_pretrained(DIR)",
        "tok = AutoTokenizer.from_pretrained(DIR)",
        'ids = model.generate(**tok("def ", return_tensors="pt"), max_new_tokens=50, '
        "do_sample=False)",
        "print(tok.decode(ids[0]))",
        "```",
    ]
    return "\n".join(lines) + "\n"


def past_block_size(c: GPTConfig) -> str:
    """What the model does past the block_size tokens it was trained on, in transformers and in
    llama.cpp."""
    if c.pos_encoding == "learned":
        return (
            f"Context: at most {c.block_size} tokens (block_size). Its positions are learned, one "
            f"per place: transformers cannot go past n_positions={c.block_size}, nor llama.cpp "
            f"past n_ctx={c.block_size}; for longer text, keep the last {c.block_size} tokens "
            "yourself."
        )
    return (
        f"Context: trained on {c.block_size} tokens (block_size). Its positions are rotary "
        f"(computed): transformers and llama.cpp both run past {c.block_size} tokens, but the "
        "model never saw such positions in training, so what it does there is unknown."
    )


def hf_kv_bytes(c: GPTConfig) -> int:
    """KV-cache bytes per token of the exported model (GPT-2 holds a GQA model's K/V heads
    repeated)."""
    if c.pos_encoding == "learned" and c.attention_type == "GQA":
        c = dataclasses.replace(c, n_kv_head=c.n_head)
    return c.kv_cache_bytes(1, 1)


def export(cfg: ExportConfig) -> None:
    out = Path(cfg.out_dir)
    # --gguf alone writes no folder: the GGUF is converted from one of its own, in a temp folder
    dest = Path(cfg.to) if cfg.to else None if cfg.gguf else out / "hf"
    if cfg.gguf and not (Path(cfg.llama_cpp) / "convert_hf_to_gguf.py").is_file():
        raise UserError(
            f"no convert_hf_to_gguf.py in --llama_cpp={cfg.llama_cpp}: pass a llama.cpp source "
            "folder (e.g. the one vendored in the llama-cpp-python sdist)"
        )
    # before the checkpoint is read; again under the lock, before anything is replaced
    check_destinations(cfg, dest)
    loaded = load_run(Source("resume"), out)
    ckpt = loaded.ckpt
    meta = loaded.meta
    model = loaded.model.float().eval()
    tok = hf.tokenizer(meta)
    hf_model = hf.to_hf(model)
    if cfg.gguf:
        check_gguf_vocabulary(tok)
    try:
        run = read_run(out) | {"dir": str(out)}
    except (UserError, OSError):
        run = {"dir": str(out)}
    gguf = Path(cfg.gguf) if cfg.gguf else None
    with export_lock([p.parent for p in (dest, gguf) if p]):
        for written in (dest, gguf):  # what an export killed there left (none is writing: the lock)
            if written:
                remove_stale_temps(written.parent, re.escape(written.name))
        replace = check_destinations(cfg, dest)
        if dest:
            write_folder(dest, replace, model, hf_model, tok, run, ckpt)
            kind = type(hf_model).__name__
            print(
                f"wrote {dest}: {kind}, {model.config.describe()}, "
                f"{model.num_params():,} parameters, {meta.get('tokenizer')} tokenizer"
            )
        if gguf:
            to_gguf(model, tok, gguf, cfg.llama_cpp, cfg.gguf_type, name=out.resolve().name)
            print(f"wrote {gguf}: {cfg.gguf_type}, by llama.cpp's convert_hf_to_gguf.py")


def check_destinations(cfg: ExportConfig, dest: Path | None) -> bool:
    """Whether dest holds an earlier export that --overwrite=True replaces; anything else there (a
    run, a dataset, other files, the working directory or the run itself, an export with folders put
    in it, or a GGUF file's place holding another file) is refused."""
    replace = dest is not None and check_replaceable(dest, "an export", keep=(cfg.out_dir,))
    others = []
    if replace:
        written = export_files(dest)
        # a folder is never an export's, whatever its smallgpt.json lists
        others = sorted(p.name for p in dest.iterdir() if p.name not in written or p.is_dir())
    if others:
        raise UserError(
            f"{dest} holds an earlier export and {', '.join(others)}, which no export wrote: move "
            f"{'them' if len(others) > 1 else 'it'} out or choose another --to (nothing was "
            "deleted)"
        )
    if replace and not cfg.overwrite:
        raise UserError(
            f"{dest} holds an earlier export: choose another --to, or --overwrite=True to replace "
            "it"
        )
    gguf = Path(cfg.gguf)
    if cfg.gguf and (gguf.is_dir() or gguf.exists() and not is_gguf(gguf)):
        raise UserError(
            f"{gguf} is there and is not a GGUF file: choose another --gguf (--overwrite replaces "
            "only a GGUF file; nothing was deleted)"
        )
    if cfg.gguf and gguf.exists() and not cfg.overwrite:
        raise UserError(
            f"{gguf} is there: choose another --gguf, or --overwrite=True to replace it"
        )
    return replace


def export_files(folder: Path) -> set[str]:
    """The names of the files the export in folder wrote: the list in its smallgpt.json (an older
    export's, without one: the names an export can write)."""
    try:
        files = json.loads((folder / MARKER).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        files = None
    if not isinstance(files, list):
        names = [p.name for p in folder.iterdir() if OLD_EXPORT_FILES.fullmatch(p.name)]
        return set(names) | {MARKER}
    # a name of the folder's own, never a path (an edited list cannot reach outside it)
    plain = {name for name in files if isinstance(name, str) and name == Path(name).name}
    return (plain - {"", ".", ".."}) | {MARKER}


def is_gguf(file: Path) -> bool:
    """Whether file starts as every GGUF file does (its magic, b'GGUF')."""
    with open(file, "rb") as f:
        return f.read(4) == b"GGUF"


def write_folder(
    dest: Path, replace: bool, model: GPT, hf_model: Any, tok: Any, run: dict, ckpt: dict
) -> None:
    """The transformers folder, its model card and its marker (smallgpt.json, which lists the files
    written), made beside dest and renamed over it: dest is replaced only once the new folder is
    whole. Of the earlier export only the files it listed are deleted (check_destinations refused a
    folder holding any other)."""
    folder = temp_path(dest)
    try:
        folder.mkdir()  # this call's own folder: the only one removed on a failure
    except OSError as e:
        raise cannot_write(dest, e) from e
    old = temp_path(dest) if replace else None  # where the earlier export waits for the rename
    try:
        hf.save(hf_model, tok, folder)
        (folder / "README.md").write_text(model_card(model, hf_model, run, ckpt))
        files = sorted([p.name for p in folder.iterdir()] + [MARKER])
        # where it came from; marks the folder as an export (smallgpt/atomic.py)
        with open(folder / MARKER, "w") as f:
            source = {
                "model_config": ckpt["model_config"],
                "iter_num": ckpt.get("iter_num"),
                "files": files,
            }
            json.dump(source, f, indent=1)
        if old is not None:
            os.replace(dest, old)
        os.replace(folder, dest)
    except OSError as e:
        if old is not None and old.exists() and not dest.exists():
            os.replace(old, dest)  # the earlier export back in its place
        raise cannot_write(dest, e) from e
    finally:
        if folder.exists():  # the new folder, had it failed half-way: only what was written here
            shutil.rmtree(folder)
    if old is not None:
        remove_export(old)


def remove_export(folder: Path) -> None:
    """Delete an earlier export: the files it wrote, then the folder, which is then empty."""
    for name in export_files(folder):
        (folder / name).unlink(missing_ok=True)
    folder.rmdir()


@contextmanager
def export_lock(folders: list[Path]) -> Iterator[None]:
    """Hold an OS lock on each folder (made if need be) for the block, so that two exports never
    write into one folder at once: the second is refused, told who holds it. The lock is on the
    folder itself, opened read-only, so it leaves no file behind; the OS releases it when the holder
    exits, even by kill -9."""
    with ExitStack() as stack:
        for folder in dict.fromkeys(p.resolve() for p in folders):
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(folder, os.O_RDONLY)
            stack.callback(os.close, fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise UserError(
                    f"{folder} is being written by another export ({lock_holder(fd)}): wait for it "
                    "to end, or choose another destination"
                ) from None
        yield


def lock_holder(fd: int) -> str:
    """'pid N' of the process holding the flock on fd's file, from /proc/locks (Linux), else 'pid
    unknown'."""
    st = os.fstat(fd)
    file = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        holders = [line.split() for line in Path("/proc/locks").read_text().splitlines()]
    except OSError:
        holders = []
    return next((f"pid {h[4]}" for h in holders if h[1] == "FLOCK" and h[5] == file), "pid unknown")


if __name__ == "__main__":
    run_cli(export, ExportConfig)
