"""Where a run's weights come from, read once: init_from parsed into a Source, and load_run, the one
way in for every script (a checkpoint, OpenAI's GPT-2 through Hugging Face, or an exported folder).
Checkpoints: the only code that knows their format. Conversions of the weights (K/V heads,
fine-tuning fits) are smallgpt/convert.py's.

A checkpoint is {'model': state_dict, 'model_config': asdict(GPTConfig), **state} with plain data
only, written atomically and loaded with weights_only=True (it cannot run code).
"""

import json
import os
import pickle
import re
import shutil
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from model import GPT, GPTConfig
from model_config import unregistered_letters
from smallgpt.atomic import atomic_open, temp_path
from smallgpt.convert import CONVERTED_KEYS
from smallgpt.data import data_dir, load_meta, open_tokens
from smallgpt.errors import UserError, first_line
from smallgpt.hf import GPT2_NAMES, from_hf
from smallgpt.tokenizer import folder_tokenizer, gpt2_folder_vocab, load_tokenizer

# the names keep_last writes: ckpt-<iteration, zero-padded to 7>.pt
KEPT_NAME = re.compile(r"ckpt-(\d{7,})\.pt")
SOURCES = (
    "'scratch', 'resume', 'auto', 'convert:<checkpoint or run folder>', "
    f"{', '.join(GPT2_NAMES)} or 'hf:<folder>'"
)


@dataclass(frozen=True, slots=True)
class Source:
    """Where a run's weights come from: init_from read once, here (no other module reads its
    prefixes)."""

    # 'scratch', 'resume', 'auto', 'convert', 'gpt2' (OpenAI's, by hub name) or 'hf' (a folder)
    kind: str
    where: str = ""  # convert: a checkpoint file or run folder; gpt2: the hub name; hf: the folder

    @property
    def pretrained(self) -> bool:
        """GPT-2's or a Hugging Face folder's weights, which decide the model's shape."""
        return self.kind in ("gpt2", "hf")

    def resolved(self, out_dir: str | Path) -> "Source":
        """'auto' as what it does: resume when out_dir holds a checkpoint, else scratch."""
        if self.kind != "auto":
            return self
        return Source("resume" if (Path(out_dir) / "ckpt.pt").exists() else "scratch")

    def checkpoint_path(self, out_dir: str | Path) -> Path:
        """The checkpoint file a resume (out_dir's) or a conversion (a file, or a run folder's)
        reads."""
        if self.kind in ("resume", "auto"):
            return Path(out_dir) / "ckpt.pt"
        path = Path(self.where)
        return path if path.suffix == ".pt" else path / "ckpt.pt"

    def __str__(self) -> str:
        """The init_from text that gives this source."""
        if self.kind in ("convert", "hf"):
            return f"{self.kind}:{self.where}"
        return self.where or self.kind


def parse_source(init_from: str) -> Source:
    """init_from as a Source; a ValueError saying what is wrong (the configs' checks turn it into
    their message)."""
    if init_from in ("scratch", "resume", "auto"):
        return Source(init_from)
    if init_from in GPT2_NAMES:
        return Source("gpt2", init_from)
    for prefix in ("convert", "hf"):
        if init_from.startswith(f"{prefix}:"):
            if not init_from[len(prefix) + 1 :]:
                raise ValueError(f"init_from={init_from!r} names no folder: give {prefix}:<folder>")
            return Source(prefix, os.path.expanduser(init_from[len(prefix) + 1 :]))  # hf:~/x
    raise ValueError(f"init_from={init_from!r} must be {SOURCES}")


@dataclass(slots=True)
class Run:
    """What load_run gives back: the model with its weights, its tokenizer (None unless asked for),
    the dataset's meta it was trained on and the checkpoint it came from (None for pretrained
    weights)."""

    model: GPT
    tokenizer: Any
    meta: dict | None
    ckpt: dict[str, Any] | None

    @property
    def config(self) -> dict[str, Any]:
        """The config of the run that wrote the checkpoint ({} for pretrained weights)."""
        return run_config(self.ckpt) if self.ckpt is not None else {}


def load_run(
    source: Source,
    out_dir: str | Path = "",
    device: str = "cpu",
    tokenizer: bool = True,
    ckpt: dict[str, Any] | None = None,
) -> Run:
    """The one way in for a run's weights (train.py, sample.py, export.py, the benchmarks): a
    checkpoint (resume: out_dir's; convert: the source's, as it is: train.py converts it), or
    GPT-2's or a Hugging Face folder's weights; with the tokenizer its text was numbered by. ckpt:
    the checkpoint, where the caller has read it already."""
    source = source.resolved(out_dir)
    if source.kind == "scratch":
        raise ValueError("a run from scratch has no weights to load")
    if source.pretrained:
        model = from_hf(source.where)
        tok = folder_tokenizer(source.where) if tokenizer else None
        return Run(model, tok, None, None)
    if ckpt is None:
        ckpt = load_checkpoint(source.checkpoint_path(out_dir), device, mmap=device == "cpu")
    meta = ckpt.get("data_meta")
    if tokenizer and not meta:  # an older checkpoint: its dataset's meta, if still there
        meta = load_meta(data_dir(run_config(ckpt).get("dataset", "?")))
    tok = load_tokenizer(meta) if tokenizer else None
    return Run(model_from_checkpoint(ckpt), tok, meta, ckpt)


def size_estimate(model: GPT, optimizer_bytes: int, data_meta: dict) -> int:
    """The bytes of a checkpoint of model: its weights, the optimizer's state, the dataset's meta (a
    BPE's whole tokenizer) and a few small things (config, RNG states)."""
    weights = sum(p.nbytes for p in model.parameters())
    small = 2**16  # the config, the RNG states
    return weights + optimizer_bytes + len(json.dumps(data_meta)) + small


def check_out_dir(out_dir: Path, ckpt_bytes: int, keep_last: int = 0) -> None:
    """Fail before training, not at a save, if out_dir is not writable or has too little free space:
    at a save the new file is written beside the old one (and the keep_last kept ones), so the run
    needs room for max(keep_last, 1) + 1 checkpoints, less the one already there."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"out_dir {out_dir} is a file, not a folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as e:  # said of out_dir, not of the probe's temp name
        raise UserError(
            f"cannot write into out_dir {out_dir} ({e.strerror or e}): choose a folder you can "
            f"write"
        ) from e
    existing = 0
    if (out_dir / "ckpt.pt").is_file():
        existing = (out_dir / "ckpt.pt").stat().st_size
    need = (max(keep_last, 1) + 1) * ckpt_bytes - existing
    free = shutil.disk_usage(out_dir).free
    if free < need:
        raise UserError(
            f"out_dir {out_dir} has {free / 2**20:,.1f} MiB free, but the run's checkpoints need "
            f"about {need / 2**20:,.1f} MiB ({ckpt_bytes / 2**20:,.1f} MiB each, "
            f"keep_last={keep_last}): free some space or choose another out_dir"
        )


DROP_VOCAB_SIZE = "drop vocab_size (the dataset's is the default) or raise it"


def check_vocabulary(
    vocab_size: int, meta: dict, trained_on: dict | None, dataset: str, advice: str | None = None
) -> None:
    """The model must have a row for each of the dataset's tokens, and a resumed one the tokens it
    was trained on; advice: what the error line tells to do (default: a training run's)."""
    if trained_on and any(trained_on.get(k) != meta.get(k) for k in ("tokenizer", "chars", "bpe")):
        raise UserError(
            f"the checkpoint was trained on other tokens than dataset {dataset}'s (its tokenizer "
            f"{trained_on.get('tokenizer')}, vocab_size {trained_on.get('vocab_size')}): "
            f"{advice or 'resume on its dataset, or use a new out_dir'}"
        )
    if vocab_size < meta["vocab_size"]:
        raise UserError(
            f"the model's vocab_size={vocab_size} is smaller than dataset {dataset}'s "
            f"{meta['vocab_size']} tokens: {advice or DROP_VOCAB_SIZE}"
        )


def check_source_tokens(
    source: Source, out_dir: str | Path, ckpt: dict | None, meta: dict, dataset: str
) -> None:
    """A conversion's source (ckpt: its checkpoint, if read already) must have been trained on the
    dataset's tokens, as a resumed run must: a UserError naming it before any work otherwise."""
    if ckpt is None:
        ckpt = load_checkpoint(source.checkpoint_path(out_dir), "cpu", mmap=True)
    vocab_size = ckpt["model_config"].get("vocab_size", 0)
    advice = (
        f"convert a run trained on dataset {dataset}'s tokens, or train on the source's dataset"
    )
    try:
        check_vocabulary(vocab_size, meta, ckpt.get("data_meta"), dataset, advice)
    except UserError as e:
        raise UserError(f"cannot convert {source.where}: {e}") from e


def check_pretrained_tokenizer(
    source: Source, meta: dict, dataset: str, advice: str | None = None
) -> None:
    """Pretrained weights (GPT-2's, or a Hugging Face folder's) must be fine-tuned on text their own
    tokenizer numbers: GPT-2's on a GPT-2 BPE dataset; a folder's tokenizer (its tokenizer.json,
    else GPT-2's) must give the dataset's own ids for the start of its val split. advice: what the
    error line tells to do (default: a fine-tuning run's)."""
    if not source.pretrained:
        return
    folder = Path(source.where)
    if source.kind == "gpt2" or not (folder / "tokenizer.json").exists():
        # GPT-2's BPE reads a GPT-2 folder only, any other is refused (no config.json: from_hf
        # says what is missing)
        if source.kind == "hf" and (folder / "config.json").is_file():
            gpt2_folder_vocab(folder)
        if meta.get("tokenizer") != "gpt2":
            raise UserError(
                f"{source} reads GPT-2's BPE tokens, and dataset {dataset} is "
                f"{meta.get('tokenizer')}-level: "
                f"{advice or 'fine-tune it on a GPT-2 BPE dataset (e.g. data/shakespeare)'}"
            )
        return
    ids = open_tokens(data_dir(dataset), "val", meta)[:2000].tolist()
    text = load_tokenizer(meta).decode(ids)
    try:
        same = folder_tokenizer(source.where).encode(text) == ids
    except UserError:  # characters its vocabulary lacks
        same = False
    if not same:
        raise UserError(
            f"the tokenizer of {folder} numbers dataset {dataset}'s text otherwise than the "
            f"dataset does: {advice or 'fine-tune on a dataset made with that tokenizer'}"
        )


def check_no_other_log(out_dir: Path, config: dict, ignored: set[str]) -> None:
    """A run from the start into an out_dir with a log but no checkpoint goes on only if that log is
    its own (a run killed before its first save, started again with the same config, keys in ignored
    aside), never appending to another run's."""
    if not (out_dir / "log.jsonl").exists():
        return
    try:
        logged = json.loads((out_dir / "config.json").read_text())
    except (OSError, ValueError):
        logged = None
    as_json = json.loads(json.dumps(config))  # tuples as lists, as the log holds them
    ours = {k: v for k, v in as_json.items() if k not in ignored}
    if not isinstance(logged, dict) or {k: logged.get(k) for k in ours} != ours:
        raise UserError(
            f"{out_dir} holds another run's log.jsonl (with no checkpoint: it stopped before its "
            "first save): choose another out_dir, or delete that one first"
        )


def save_checkpoint(
    path: str | Path, model: GPT, keep_last: int = 0, model_state: dict | None = None, **state: Any
) -> None:
    """Write {'model', 'model_config', **state} atomically (atomic_open): a crash mid-write leaves
    the previous checkpoint intact. 'model' is model_state (default: model's state_dict); state
    holds plain data only. keep_last > 0 also keeps the file as ckpt-<state's iter_num>.pt beside
    it, and only the keep_last newest."""
    path = Path(path)
    try:
        with atomic_open(path) as f:
            torch.save(
                {
                    "model": model.state_dict() if model_state is None else model_state,
                    "model_config": asdict(model.config),
                    **state,
                },
                f,
            )
    except (OSError, RuntimeError) as e:  # torch's writer says a full disk as a RuntimeError
        raise UserError(
            f"cannot write checkpoint {path} ({first_line(e)}): the disk may be full; any previous "
            f"checkpoint is kept: free some space and resume with --init_from=resume"
        ) from e
    if keep_last:
        keep_copy(path, state["iter_num"], keep_last)


def keep_copy(path: Path, iter_num: int, keep_last: int) -> None:
    """Keep the checkpoint just written at path as ckpt-<iter_num>.pt too, and only the keep_last
    newest of those: files of exactly that name (seven digits), the only ones pruned, so a user's
    ckpt-best.pt or ckpt-5.pt stays."""
    kept = path.with_name(f"ckpt-{iter_num:07d}.pt")
    part = temp_path(kept)
    try:
        # no extra disk: path is replaced by the next save, never rewritten in place
        os.link(path, part)
    except OSError:  # a file system without hard links
        shutil.copyfile(path, part)
    os.replace(part, kept)
    ours = {p: KEPT_NAME.fullmatch(p.name) for p in path.parent.iterdir()}
    by_iteration = sorted((int(match[1]), p) for p, match in ours.items() if match)
    for _, old in by_iteration[:-keep_last]:
        old.unlink()


def load_checkpoint(
    path: str | Path, map_location: str | torch.device = "cpu", mmap: bool = False
) -> dict[str, Any]:
    """A checkpoint written by save_checkpoint, loaded with weights_only=True (mmap: its tensors are
    read from the file when used)."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path} is a folder, not a checkpoint file")
    if not path.is_file():
        raise UserError(
            f"no checkpoint at {path}: train one first (python train.py ...) or fix out_dir"
        )
    # torch.save writes a zip archive; its directory is at the end of the file
    if not zipfile.is_zipfile(path):
        raise UserError(
            f"checkpoint {path} is corrupt or truncated (not a whole torch.save archive)"
        )
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        # torch names a refused global one of two ways (a blocked module such as os: the second)
        unsafe = re.search(
            r"Unsupported global: GLOBAL (\S+)|unsupported GLOBAL (\S+) whose module", str(e)
        )
        # torch's message advises weights_only=False first: quote the unpickler's reason
        if unsafe is None:
            reason = re.search(r"WeightsUnpickler error:\s*(.+)", str(e))
            why = reason[1].strip() if reason else first_line(e)
            raise UserError(f"checkpoint {path} is corrupt ({why})") from e
        raise UserError(
            f"refusing to load {path}: it holds {unsafe[1] or unsafe[2]}, not only tensors and "
            "plain data, and loading it could run code"
        ) from e
    except (RuntimeError, EOFError, OSError) as e:
        raise UserError(f"checkpoint {path} is corrupt or truncated ({first_line(e)})") from e
    if (
        not isinstance(ckpt, dict)
        or "model" not in ckpt
        or not isinstance(ckpt.get("model_config"), dict)
    ):
        raise UserError(
            f"{path} is not a checkpoint written by this project (no 'model' and 'model_config')"
        )
    return ckpt


def run_config(ckpt: dict[str, Any]) -> dict[str, Any]:
    """The config of the run that wrote ckpt, as a dict ({} from an older checkpoint without
    one)."""
    return ckpt["config"] if isinstance(ckpt.get("config"), dict) else {}


def start_from(
    source: Source, out_dir: str | Path
) -> tuple[dict[str, Any] | None, dict[str, Any], str]:
    """The checkpoint a run from source starts from, read here once (train.py passes it on), the
    config keys it gives the run, and where they come from. To resume ('resume', or 'auto' with a
    checkpoint in out_dir): the run's config and its model's (a fine-tuned GPT-2 keeps GPT-2's
    shape), out_dir and init_from aside; to convert: the model's but the keys a conversion changes
    (convert.CONVERTED_KEYS). (None, {}, '') where there is none."""
    path = source.checkpoint_path(out_dir)
    source = source.resolved(out_dir)
    if source.kind == "resume" and path.is_file():
        ckpt = load_checkpoint(path, "cpu", mmap=True)
        check_kinds_registered(ckpt["model_config"], f"checkpoint {path}'s model")
        keys = {
            k: v
            for k, v in (run_config(ckpt) | ckpt["model_config"]).items()
            if k not in ("out_dir", "init_from")
        }
        return ckpt, keys, f"the run config in {path}"
    if source.kind == "convert" and path.is_file():
        ckpt = load_checkpoint(path, "cpu", mmap=True)
        check_kinds_registered(ckpt["model_config"], f"checkpoint {path}'s model")
        kept = ckpt["model_config"].items()
        keys = {k: v for k, v in kept if k not in CONVERTED_KEYS}
        return ckpt, keys, f"the model in {path}"
    return None, {}, ""


def check_kinds_registered(model_config: dict[str, Any], where: str) -> None:
    """A UserError where the checkpoint's layer_pattern names a kind (a letter, as register_kind
    takes) that this process has not registered: a run that registered it saved it (a test, a
    script's kind), and GPTConfig would read the letter as a mistake in the checkpoint."""
    pattern, unknown = unregistered_letters(model_config)
    if unknown:
        kinds = ", ".join(map(repr, unknown))
        raise UserError(
            f"{where} uses layer kind {kinds} (layer_pattern={pattern!r}), which this code does "
            "not register: register it before loading (import the module that defines it and "
            "call model.register_kind, or make it a row of model.LAYER_KINDS)"
        )


def model_from_checkpoint(ckpt: dict[str, Any]) -> GPT:
    """The GPT a checkpoint describes, with its weights."""
    check_kinds_registered(ckpt["model_config"], "checkpoint's model")
    try:
        model = GPT(GPTConfig(**ckpt["model_config"]))
    except (TypeError, ValueError) as e:
        raise UserError(f"checkpoint's model_config does not fit GPTConfig ({e})") from e
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        reason = first_line(e, skip="Error(s) in loading")
        raise UserError(f"checkpoint weights do not match its model_config ({reason})") from e
    return model
