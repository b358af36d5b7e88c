"""nanoGPT's command line, `python train.py config/a.py --key=value ...`, checked by a dataclass.

Config files are trusted Python, run in a fresh namespace; their top-level names and the --key=value
overrides are applied in order, each validated against the dataclass's field types. Nothing here
touches globals(). UserError is what every module raises for a mistake the user fixes; run_cli
prints those as one line."""

import ast
import dataclasses
import difflib
import math
import os
import re
import sys
import traceback
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class UserError(Exception):
    """A mistake the user can fix (a config value, a missing file, no network), said in one line:
    what happened, why, and what to do. Scripts print it as `error: ...` and exit 2; any other
    exception keeps its traceback."""


def _quiet_interrupt(hook: Callable) -> Callable:
    """A sys.excepthook that says a Ctrl-C in one line, as run_cli does; the rest go to hook."""

    def excepthook(kind: type[BaseException], value: BaseException,
                   tb: types.TracebackType | None) -> None:
        if issubclass(kind, KeyboardInterrupt):
            print("interrupted", file=sys.stderr)
        else:
            hook(kind, value, tb)

    return excepthook


# Every script imports this module before torch, so a Ctrl-C while the libraries import ends in one
# line, not a traceback through them; run_cli handles the rest. Code that catches it is unaffected.
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


def _coerce(key: str, value: Any, hint: Any, source: str, raw: str | None,
            expected: str = "") -> Any:
    """value converted to the type hint, or a UserError naming key, value, type and source."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if (value is None or raw == "None") and type(None) in args:
            return None
        expected = " or ".join(map(_name, args))
        for member in [a for a in args if a is not type(None)]:  # the first type that takes it
            try:
                return _coerce(key, value, member, source, raw)
            except OutOfRange:  # the right type, a value it cannot hold: say that, not "wrong type"
                raise
            except UserError:
                pass
    elif origin in (list, tuple) and args:
        items = value
        quoted = isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)
        if raw is not None and args[0] is str and not quoted:  # text as typed: --tags=[1,2e3]
            value = raw
        if isinstance(value, str):  # --tags=a,b or --methods=[a,b]
            inner = value.removeprefix("[").removesuffix("]")
            items = [part.strip() for part in inner.split(",") if part.strip()]
        elif not isinstance(value, list | tuple):
            items = [value]  # --kv_heads=3: a list of one
        try:
            if origin is tuple and Ellipsis not in args:  # fixed size, e.g. (n_layer, n_embd)
                if len(items) == len(args):
                    pairs = zip(items, args, strict=True)
                    return [_coerce(key, item, member, source, None) for item, member in pairs]
            else:
                return [_coerce(key, item, args[0], source, None) for item in items]
        except OutOfRange:
            raise
        except UserError:
            pass
    elif hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return _in_range(key, value, source)
    elif hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return _in_range(key, float(value), source)
    elif hint is str:
        if raw is not None:  # from the command line: the text as typed, unless a quoted literal
            return value if isinstance(value, str) else raw
        if isinstance(value, str):
            return value
    name = expected or _name(hint)
    given = raw if raw is not None else repr(value)
    raise UserError(f"{key}={given} (from {source}) has the wrong type: "
                    f"expected {name}, got {type(value).__name__}")


INT64_MAX = 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38  # the largest float32
FLOAT32_ZERO = 2.0**-150  # what rounds to float32's zero
NON_DECIMAL = re.compile(r"(?<![\w.])[-+]?0[xob]", re.IGNORECASE)


class OutOfRange(UserError):
    """A value of the right type that the type it ends up in cannot hold."""


def _in_range(key: str, value: int | float, source: str) -> int | float:
    """value if the type it ends up in holds it, else an OutOfRange error: ints are int64 in torch
    and numpy, floats at least float32 (model tensors, learning rates in fp32 optimizer state)."""
    if isinstance(value, int):
        if abs(value) > INT64_MAX:
            raise OutOfRange(f"{key}={value} (from {source}) does not fit a 64-bit integer "
                             f"(at most {INT64_MAX:,})")
        return value
    if not math.isfinite(value):
        raise OutOfRange(f"{key}={value} (from {source}) must be a finite number")
    if abs(value) > FLOAT32_MAX or 0 < abs(value) <= FLOAT32_ZERO:
        too_large = abs(value) > 1
        size = "large" if too_large else "small"
        becomes = "infinity" if too_large else "zero"
        raise OutOfRange(f"{key}={value} (from {source}) is too {size} for float32, "
                         f"the precision it is used in (it would become {becomes}): "
                         "give a size between 1.5e-45 and 3.4e38, or 0")
    return value


def _name(hint: Any) -> str:
    if hint is type(None):
        return "None"
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def _unknown(key: str, known: list[str], source: str) -> UserError:
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    if close:
        suggestions = " or ".join(close)
        hint = f"; did you mean {suggestions}?"
    else:
        hint = "; see the defaults at the top of the script"
    if source.startswith("config file"):
        hint += f" (a helper variable in a config file starts with _, e.g. _{key} = ...)"
    return UserError(f"unknown config key '{key}' (from {source}){hint}")


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
    return {name: value for name, value in namespace.items()
            if not name.startswith("_") and not isinstance(value, not_settings)}


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
                raise UserError(f"{arg} gives {key} an empty value (an unset shell variable?): "
                                f"give one, or leave the flag out for the default {default!r}")
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


def checked_values(cls: type, items: dict[str, Any], source: str, raws: dict[str, str] | None = None
                   ) -> dict[str, Any]:
    """items (fields of cls, from source) checked and coerced to the fields' types, as given_values
    does (raws: the text typed on the command line for a key)."""
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    for key in items:
        if key not in hints:  # '' too: --=5
            raise _unknown(key, known, source)
    typed = raws or {}
    return {key: _coerce(key, value, hints[key], source, typed.get(key))
            for key, value in items.items()}


def split_args(argv: list[str], cls: type) -> tuple[list[str], list[str]]:
    """(the --key=value flags for fields of cls, everything else), for a script whose own keys
    come with train.py's config files and flags."""
    keys = {f.name for f in dataclasses.fields(cls)}
    ours = [arg for arg in argv if arg.startswith("--") and arg[2:].split("=", 1)[0] in keys]
    rest = [arg for arg in argv if arg not in ours]
    return ours, rest


def with_fields_of(source: type, **defaults: Any) -> Callable[[type[T]], type[T]]:
    """Class decorator: the dataclass gains every field of the dataclass `source` after its own,
    with source's type and default (or the one given here; a None default admits None), so a new
    field of source needs no copy."""

    def extend(cls: type[T]) -> type[T]:
        hints = typing.get_type_hints(source)
        unknown = defaults.keys() - hints.keys()
        if unknown:
            names = ", ".join(sorted(unknown))
            raise TypeError(f"{source.__name__} has no field {names}")
        extra = []
        for field in dataclasses.fields(source):
            default = defaults.get(field.name, field.default)
            hint = hints[field.name]
            if default is None:
                hint = hint | None
            extra.append((field.name, hint, dataclasses.field(default=default)))
        new = dataclasses.make_dataclass(cls.__name__, extra, bases=(cls,), slots=True)
        new.__module__ = cls.__module__
        new.__qualname__ = cls.__qualname__
        new.__doc__ = cls.__doc__
        return new

    return extend


def print_config(cfg: Any) -> None:
    width = max(len(f.name) for f in dataclasses.fields(cfg))
    for f in dataclasses.fields(cfg):
        print(f"  {f.name:<{width}} = {getattr(cfg, f.name)!r}")


def run_cli(main: Callable[[T], Any], config: type[T] | Callable[[list[str]], T],
            argv: list[str] | None = None, keys: tuple[type, ...] = ()) -> None:
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
        print("interrupted", file=sys.stderr)
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
