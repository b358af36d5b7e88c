"""nanoGPT's command line, `python train.py config/a.py --key=value ...`, checked by a dataclass.

Config files are trusted Python, run in a fresh namespace; their top-level names and the --key=value
overrides are applied in order, each checked against the dataclass's field types
(smallgpt/fieldtypes.py). Nothing here touches globals(). run_cli prints a UserError
(smallgpt/errors.py) as one line."""

import ast
import dataclasses
import gc
import os
import sys
import traceback
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from smallgpt.errors import USER_ERRORS, UserError, first_line, say_interrupted
from smallgpt.fieldtypes import NON_DECIMAL, checked_values

T = TypeVar("T")


def _read_file(path: str) -> dict[str, Any]:
    """Top-level names a config file defines (imports, functions and _private names left out)."""
    file = Path(path)
    if not file.is_file():
        what = "is not a file" if file.exists() else "not found"
        raise UserError(f"config file {path} {what} (arguments are config files or --key=value)")
    try:
        code = compile(file.read_text(encoding="utf-8"), str(file), "exec")
    except UnicodeDecodeError as e:
        reason = f"{e.reason} at byte {e.start}"
        raise UserError(f"config file {path} is not UTF-8 text ({reason})") from e
    except SyntaxError as e:
        raise UserError(f"config file {path} line {e.lineno}: {e.msg}") from e
    namespace: dict[str, Any] = {"__file__": str(file)}
    try:
        exec(code, namespace)
    except Exception as e:  # the file's own code failed: say where, as a syntax error does
        frames = traceback.extract_tb(e.__traceback__)
        in_file = [frame.lineno for frame in frames if frame.filename == str(file)]
        line = in_file[-1] if in_file else "?"
        error = f"{type(e).__name__}: {first_line(e)}"
        raise UserError(f"config file {path} line {line}: {error}") from e
    not_settings = types.ModuleType | types.FunctionType | type
    return {
        name: value
        for name, value in namespace.items()
        if not name.startswith("_") and not isinstance(value, not_settings)
    }


def parse_config(cls: type[T], argv: list[str]) -> T:
    """An instance of the dataclass cls from config files and --key=value flags, left to right."""
    return build(cls, given_values(cls, argv))


def build(cls: type[T], values: dict[str, Any]) -> T:
    """cls(**values), with the errors of its own checks raised as UserError."""
    try:
        return cls(**values)
    except ValueError as e:  # the dataclass's own checks of values and combinations (__post_init__)
        raise UserError(str(e)) from e


def given_values(cls: type, argv: list[str]) -> dict[str, Any]:
    """The values config files and --key=value overrides give cls's fields, checked and coerced:
    only the keys given (a resumed run takes the others from its checkpoint)."""
    values: dict[str, Any] = {}
    for arg in argv:
        if arg.startswith("--"):
            if "=" not in arg:
                raise UserError(f"override {arg} needs a value: --key=value")
            key, raw = arg[2:].split("=", 1)
            default = next((f.default for f in dataclasses.fields(cls) if f.name == key), None)
            # e.g. --out_dir=$UNSET means a mistake, not "the current folder"
            if raw == "" and isinstance(default, str) and default:
                raise UserError(
                    f"{arg} gives {key} an empty value (an unset shell variable?): "
                    f"give one, or leave the flag out for the default {default!r}"
                )
            try:
                value = ast.literal_eval(raw)
            except (ValueError, SyntaxError):
                value = raw
            if NON_DECIMAL.search(raw):  # Python reads 0x64 as 100; here numbers are decimal
                value = raw
            values |= checked_values(cls, {key: value}, f"flag {arg}", {key: raw})
        else:
            values |= checked_values(cls, _read_file(arg), f"config file {arg}")
    return values


def split_args(argv: list[str], cls: type) -> tuple[list[str], list[str]]:
    """(the --key=value flags for fields of cls, everything else), for a script whose own keys
    come with train.py's config files and flags."""
    keys = {f.name for f in dataclasses.fields(cls)}
    ours = [arg for arg in argv if arg.startswith("--") and arg[2:].split("=", 1)[0] in keys]
    rest = [arg for arg in argv if arg not in ours]
    return ours, rest


def print_config(cfg: Any) -> None:
    width = max(len(f.name) for f in dataclasses.fields(cfg))
    for f in dataclasses.fields(cfg):
        print(f"  {f.name:<{width}} = {getattr(cfg, f.name)!r}")


def run_cli(
    main: Callable[[T], Any],
    config: type[T] | Callable[[list[str]], T],
    argv: list[str] | None = None,
    keys: tuple[type, ...] = (),
) -> None:
    """Parse the command line (into the dataclass `config`, or by the function `config`, whose keys
    are those of the dataclasses `keys`) and run main on it. A user error (USER_ERRORS) ends the
    process with one `error: ...` line and exit 2 (SMALLGPT_DEBUG=1 shows its traceback); anything
    else is a bug or a failure inside a library and keeps its traceback."""
    argv = sys.argv[1:] if argv is None else argv
    keys = (config,) if dataclasses.is_dataclass(config) else keys
    if {"-h", "--help"} & set(argv) and keys:
        usage = f"usage: python {sys.argv[0]} [config files] [--key=value ...]"
        print(f"{usage}; the keys and their defaults:")
        for cls in keys:
            if len(keys) > 1:
                print(f"{cls.__name__}:")
            print_config(cls())
        return
    try:
        cfg = parse_config(config, argv) if dataclasses.is_dataclass(config) else config(argv)
        main(cfg)
    except KeyboardInterrupt:  # files are written atomically, so nothing is left half-written
        say_interrupted()
        sys.exit(130)
    except USER_ERRORS as e:
        if os.environ.get("SMALLGPT_DEBUG") == "1":
            raise
        prefix = ""
        rank = os.environ.get("RANK")
        if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1":  # name the failing rank
            prefix = f"[rank {rank}] "
        message = " ".join(str(e).split())  # one line, whatever line breaks the message holds
        print(f"{prefix}error: {message}", file=sys.stderr)
        sys.exit(2)
    finally:  # the exit then skips collecting torch's objects (docs/performance-cpu.md "Start-up")
        gc.freeze()
