"""Files that are never half-written: everything the project writes for keeps (checkpoints, token files, reports)
goes through atomic_open, so a crash or kill -9 at any moment leaves the previous file intact. And folders that
never hold two runs at once: folder_lock."""

import fcntl
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from configurator import UserError


@contextmanager
def atomic_open(path: str | Path, mode: str = "wb", **open_args: object) -> Iterator[IO]:
    """Open a temp file beside path for writing; on a clean exit flush it, fsync it and rename it over path, on an
    exception delete it (path is left as it was)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, mode, **open_args) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def folder_lock(folder: str | Path, what: str) -> Iterator[None]:
    """Hold an OS lock on folder/.lock for the block (the folder is made if need be): another process asking for
    it is refused at once, told who holds it. The OS releases it when the holder exits, even by kill -9, so it is
    never stale. A folder made here and left holding only the lock is removed at the end."""
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
            raise UserError(f"{folder} is in use by {f.read().strip() or 'another process'}: wait for it to end, or "
                            f"choose another out_dir") from None
        f.seek(0)
        f.truncate()
        f.write(f"{what} (pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')})")
        f.flush()
        try:
            yield
        finally:
            f.seek(0)
            f.truncate()
            if created and [p.name for p in folder.iterdir()] == [".lock"]:
                lock.unlink()
                folder.rmdir()
