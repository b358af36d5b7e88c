"""The values a config file or a --key=value flag gives a dataclass, checked against its fields: an
unknown key is named with its close matches, each value converted to its field's type hint
(checked_values) or refused in one line. And with_fields_of, a dataclass that takes another's fields
(TrainConfig takes GPTConfig's)."""

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from smallgpt.errors import UserError

T = TypeVar("T")


def coerce(key: str, value: Any, hint: Any, source: str, raw: str | None) -> Any:
    """value converted to the type hint, or a UserError naming key, value, type and source (raw:
    the text typed on the command line, if any)."""
    # nan, inf, -infinity
    if hint in (int, float) and isinstance(value, str) and not _finite(value):
        raise OutOfRange(f"{key}={value} (from {source}) must be a finite number")
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    expected = _name(hint)
    if origin in (typing.Union, types.UnionType):
        if (value is None or raw == "None") and type(None) in args:
            return None
        expected = " or ".join(map(_name, args))
        result = _coerce_union(key, value, args, source, raw)
    elif origin in (list, tuple) and args:
        quoted = isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)
        if raw is not None and args[0] is str and not quoted:  # text as typed: --tags=[1,2e3]
            value = raw
        result = _coerce_sequence(key, value, origin, args, source)
    else:
        result = _coerce_scalar(key, value, hint, source, raw)
    if result is not NOT_TAKEN:
        return result
    given = raw if raw is not None else repr(value)
    raise UserError(
        f"{key}={given} (from {source}) has the wrong type: "
        f"expected {expected}, got {type(value).__name__}"
    )


NOT_TAKEN = object()  # what a _coerce_ helper gives for a value its type does not take


def _coerce_union(key: str, value: Any, args: tuple, source: str, raw: str | None) -> Any:
    """value as the first of the union's member types (args) that takes it, or NOT_TAKEN."""
    for member in [a for a in args if a is not type(None)]:
        try:
            return coerce(key, value, member, source, raw)
        except OutOfRange:  # the right type, a value it cannot hold: say that, not "wrong type"
            raise
        except UserError:
            pass
    return NOT_TAKEN


def _coerce_sequence(key: str, value: Any, origin: type, args: tuple, source: str) -> Any:
    """value as a list of the member types args (origin: list, or a tuple's), or NOT_TAKEN."""
    items = value
    if isinstance(value, str):  # --tags=a,b or --methods=[a,b]
        inner = value.removeprefix("[").removesuffix("]")
        items = [part.strip() for part in inner.split(",") if part.strip()]
    elif not isinstance(value, list | tuple):
        items = [value]  # --kv_heads=3: a list of one
    try:
        if origin is tuple and Ellipsis not in args:  # fixed size, e.g. (n_layer, n_embd)
            if len(items) != len(args):
                return NOT_TAKEN
            pairs = zip(items, args, strict=True)
            return [coerce(key, item, member, source, None) for item, member in pairs]
        return [coerce(key, item, args[0], source, None) for item in items]
    except OutOfRange:
        raise
    except UserError:
        return NOT_TAKEN


def _coerce_scalar(key: str, value: Any, hint: Any, source: str, raw: str | None) -> Any:
    """value as a bool, int, float or str (hint), or NOT_TAKEN (as for any other hint)."""
    if hint is bool:
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
        # from the command line: the text as typed, unless a quoted literal
        if raw is not None and not isinstance(value, str):
            value = raw
        if isinstance(value, str):
            return os.path.expanduser(value) if key in PATH_KEYS else value
    return NOT_TAKEN


# The keys that name a file or folder: a leading ~ is the home folder, as a shell reads ~ at a
# word's start (a shell leaves --out_dir=~/x as it is)
PATH_KEYS = ("out_dir", "dataset", "input", "to", "gguf", "llama_cpp", "nanogpt_dir")
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
            raise OutOfRange(
                f"{key}={value} (from {source}) does not fit a 64-bit integer "
                f"(at most {INT64_MAX:,})"
            )
        return value
    if not math.isfinite(value):
        raise OutOfRange(f"{key}={value} (from {source}) must be a finite number")
    if abs(value) > FLOAT32_MAX or 0 < abs(value) <= FLOAT32_ZERO:
        too_large = abs(value) > 1
        size = "large" if too_large else "small"
        becomes = "infinity" if too_large else "zero"
        raise OutOfRange(
            f"{key}={value} (from {source}) is too {size} for float32, "
            f"the precision it is used in (it would become {becomes}): "
            "give a size between 1.5e-45 and 3.4e38, or 0"
        )
    return value


def _finite(text: str) -> bool:
    """False for text that Python reads as a float that is not finite (nan, inf, -Infinity), else
    True."""
    try:
        return math.isfinite(float(text))
    except ValueError:  # not a number at all: a wrong type, said as such
        return True


def _name(hint: Any) -> str:
    if hint is type(None):
        return "None"
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


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


def checked_values(
    cls: type, items: dict[str, Any], source: str, raws: dict[str, str] | None = None
) -> dict[str, Any]:
    """items (fields of cls, from source) checked and coerced to the fields' types, as given_values
    does (raws: the text typed on the command line for a key)."""
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    for key in items:
        if key not in hints:  # '' too: --=5
            raise unknown_key(key, known, source)
    typed = raws or {}
    checked = {}
    for key, value in items.items():
        checked[key] = coerce(key, value, hints[key], source, typed.get(key))
    return checked


def unknown_key(key: str, known: list[str], source: str) -> UserError:
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    if close:
        suggestions = " or ".join(close)
        hint = f"; did you mean {suggestions}?"
    else:
        hint = "; see the defaults at the top of the script"
    if source.startswith("config file"):
        hint += f" (a helper variable in a config file starts with _, e.g. _{key} = ...)"
    return UserError(f"unknown config key '{key}' (from {source}){hint}")
