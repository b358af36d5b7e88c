"""Files that are never half-written: everything the project writes for keeps (checkpoints, token files, reports)
goes through atomic_open, so a crash or kill -9 at any moment leaves the previous file intact."""

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO


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
