"""UserError, a mistake the user fixes, and how the scripts say it: one line, no traceback.

Every script imports this module (through configurator.py) before torch, so its sys.excepthook also
says a Ctrl-C while the libraries import in one line."""

import sys
import types
from collections.abc import Callable


class UserError(Exception):
    """A mistake the user can fix (a config value, a missing file, no network), said in one line:
    what happened, why, and what to do. Scripts print it as `error: ...` and exit 2; any other
    exception keeps its traceback."""


def say_interrupted() -> None:
    """'interrupted' on stderr, on a line of its own: a progress bar the Ctrl-C cut short is closed
    first (its line ended), also one interrupted while it was being made (drawn, but not yet told
    so: its close would leave the line open)."""
    tqdm = sys.modules.get("tqdm")
    if tqdm is not None:
        for bar in list(tqdm.tqdm._instances):
            drawing = hasattr(bar, "sp") and not hasattr(bar, "last_print_t")
            bar.close()
            if drawing:
                bar.fp.write("\n")
    print("interrupted", file=sys.stderr)


def _quiet_interrupt(hook: Callable) -> Callable:
    """A sys.excepthook that says a Ctrl-C in one line, as run_cli does; the rest go to hook."""

    def excepthook(
        kind: type[BaseException], value: BaseException, tb: types.TracebackType | None
    ) -> None:
        if issubclass(kind, KeyboardInterrupt):
            say_interrupted()
        else:
            hook(kind, value, tb)

    return excepthook


# Installed on import: code that catches the Ctrl-C is unaffected, and run_cli handles the rest.
sys.excepthook = _quiet_interrupt(sys.excepthook)

# What run_cli reports in one line: the project's UserError, and OSError, the operating system
# refusing a path the user gave (missing, unreadable, unwritable, full).
USER_ERRORS = (UserError, OSError)


def first_line(e: BaseException, skip: str | None = None) -> str:
    """The first non-empty line of e's message not starting with skip, or e's type's name: the
    reason a UserError quotes from a library's many-line error."""
    lines = [line.strip() for line in str(e).splitlines()]
    lines = [line for line in lines if line and not (skip and line.startswith(skip))]
    return lines[0][:300] if lines else type(e).__name__
