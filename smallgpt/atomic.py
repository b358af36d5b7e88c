"""Files that are never half-written: everything the project writes for keeps (checkpoints, token
files, reports) goes through atomic_open, so a crash or kill -9 at any moment leaves the previous
file intact. Folders that never hold two runs at once: folder_lock. And deletes that name only what
the project wrote: a temp name of its own pattern (temp_path), removed when stale under the lock of
its folder (remove_stale_temps)."""

import fcntl
import json
import os
import re
import secrets
import shutil
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from smallgpt.errors import UserError

TEMP_MARK = ".smallgpt-"  # a temp file or folder is .<name>.smallgpt-<8 hex digits>, beside <name>


def temp_path(path: str | Path) -> Path:
    """A fresh name beside path for writing it before a rename: unique (two writers never share
    one), hidden, and of a pattern only this project writes, so that a stale one (a kill -9) can be
    told and removed."""
    path = Path(path)
    return path.with_name(f".{path.name}{TEMP_MARK}{secrets.token_hex(4)}")


def remove_stale_temps(folder: str | Path, names: str) -> None:
    """Delete the temp files and folders that writers of folder/<name> left behind (temp_path's),
    for each name that the regular expression names matches. Call it only under the lock that every
    writer of those names holds: then none of them is being written."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    stale = re.compile(rf"\.({names}){re.escape(TEMP_MARK)}[0-9a-f]{{8}}")
    for path in folder.iterdir():
        if not stale.fullmatch(path.name):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def cannot_write(path: Path, e: OSError) -> UserError:
    """The one line for a file or folder that the system refused to create at path (read-only, a
    file in the way)."""
    return UserError(
        f"cannot write {path} ({e.strerror or e}): is {path.parent} a folder you can write?"
    )


@contextmanager
def atomic_open(path: str | Path, mode: str = "wb", **open_args: object) -> Iterator[IO]:
    """Open a temp file beside path (temp_path) for writing; on a clean exit flush it, fsync it and
    rename it over path, on an exception delete it (path is left as it was)."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        f = open(tmp, mode.replace("w", "x"), **open_args)  # x: never an existing file
    except OSError as e:  # said of the file the user asked for, not of its temp name
        raise cannot_write(path, e) from e
    try:  # from here on tmp is this call's own file, the only one deleted on a failure
        with f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def folder_lock(folder: str | Path, what: str) -> Iterator[None]:
    """Hold an OS lock on folder/.lock for the block (the folder is made if need be): another
    process asking for it is refused at once, told who holds it. The OS releases it when the holder
    exits, even by kill -9, so it is never stale. A folder made here and left holding only the lock
    is removed at the end."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"out_dir {folder} is a file, not a folder")
    created = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot make out_dir {folder}: {e.strerror}") from e
    lock = folder / ".lock"
    with open(lock, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise UserError(
                f"{folder} is in use by {holder}: wait for it to end, or choose another out_dir"
            ) from None
        f.seek(0)
        f.truncate()
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        f.write(f"{what} (pid {os.getpid()} on {socket.gethostname()}, since {since})")
        f.flush()
        try:
            yield
        finally:
            f.seek(0)
            f.truncate()
            if created and [p.name for p in folder.iterdir()] == [".lock"]:
                lock.unlink()
                folder.rmdir()


def lock_holder(folder: Path) -> str | None:
    """Who holds folder's lock (folder_lock's: e.g. a sweep's root while compare.py runs), or None;
    tried without waiting, and let go at once."""
    lock = folder / ".lock"
    if not lock.is_file():
        return None
    with open(lock) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return f.read().strip() or "another process"
    return None


# What this project writes into a folder, by the file that marks each kind (a run's checkpoint or
# log, a dataset's meta.json, an export's smallgpt.json; a comparison's compare.json and the
# scripts' zoology.json and ablation.json, each written when its tool makes or adopts the folder,
# claim_folder): the rule for any command that writes into or replaces a folder.
KIND_MARKERS = {
    "a run": ("ckpt.pt", "log.jsonl"),
    "a dataset": ("meta.json",),
    "an export": ("smallgpt.json",),
    "a comparison": ("compare.json",),
    "a Zoology figure": ("zoology.json",),
    "an MLA ablation": ("ablation.json",),
}


def folder_kind(folder: str | Path) -> str:
    """What folder holds: 'nothing' (absent or empty), 'a run', 'a dataset', 'an export', or 'other
    files'."""
    folder = Path(folder)
    if not folder.is_dir() or not any(p.name != ".lock" for p in folder.iterdir()):
        return "nothing"
    for kind, markers in KIND_MARKERS.items():
        if any((folder / m).exists() for m in markers):
            return kind
    return "other files"


def check_replaceable(dest: str | Path, kind: str, keep: tuple[str | Path, ...] = ()) -> bool:
    """Whether dest may be replaced by a new `kind` ('an export', ...): True when it holds one
    (written by this project as that kind of thing), False when it is absent or empty. A UserError
    when it holds anything else, or is (or contains) the working directory or one of the paths in
    keep: --overwrite never deletes those."""
    dest = Path(dest).resolve()
    for path in (Path.cwd(), *map(Path, keep)):
        path = path.resolve()
        if path == dest or dest in path.parents:
            what = "the working directory" if path == Path.cwd().resolve() else str(path)
            raise UserError(
                f"{dest} is or contains {what}: choose another destination (nothing was deleted)"
            )
    held = folder_kind(dest) if not dest.is_file() else "a file"
    if held == "nothing":
        return False
    if held != kind:
        raise UserError(
            f"{dest} holds {held}, not {kind} written by this project: --overwrite replaces only "
            f"{kind}; choose another destination (nothing was deleted)"
        )
    return True


def check_writes_into(folder: str | Path, kind: str, writes: tuple[str, ...]) -> None:
    """A command that writes `kind` (its files `writes`) into folder goes on only where the folder
    holds nothing, the same kind, or other files none of which it would replace; else a UserError
    (nothing was written)."""
    held = folder_kind(folder)
    clobbered = [name for name in writes if (Path(folder) / name).exists()]
    if held not in ("nothing", kind) and (held != "other files" or clobbered):
        # a command of another process starting there (its files half written): that is the cause
        holder = lock_holder(Path(folder)) if Path(folder).is_dir() else None
        if holder is not None:
            raise UserError(
                f"{folder} is in use by {holder}: wait for it to end, or choose another out_dir"
            )
        what = f"; its {', '.join(clobbered)} would be replaced" if clobbered else ""
        raise UserError(
            f"{folder} holds {held}, not {kind}{what}: choose another folder (nothing was written)"
        )


def check_claimable(folder: str | Path, kind: str) -> None:
    """Before any work: a tool that writes `kind` (a key of KIND_MARKERS whose marker it writes)
    takes folder only where it is absent, empty, or already marked as that kind (an earlier run of
    the tool); else a UserError naming what it holds (nothing was written)."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{folder} is a file, not a folder: choose another folder")
    held = folder_kind(folder)
    if held in ("nothing", kind):
        return
    what = held
    if held == "other files":
        names = sorted(p.name for p in folder.iterdir() if p.name != ".lock")
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        what = f"files this tool did not write ({shown})"
    marker = KIND_MARKERS[kind][0]
    raise UserError(
        f"{folder} holds {what}, not {kind} (no {marker}, which marks one): choose an empty or "
        f"new folder (nothing was written)"
    )


def claim_folder(folder: str | Path, kind: str, record: dict) -> None:
    """Make folder (check_claimable's rule, checked again) and mark it as `kind` with its marker
    file holding record (e.g. the command), once: what later runs of the tool recognise."""
    check_claimable(folder, kind)
    folder = Path(folder)
    marker = folder / KIND_MARKERS[kind][0]
    if marker.exists():
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise cannot_write(folder, e) from e
    with atomic_open(marker, "w") as f:
        json.dump({"kind": kind, **record}, f, indent=1)
