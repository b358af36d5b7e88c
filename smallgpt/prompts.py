"""Prompts for sample.py: the text --start gives (itself, FILE:path or LINES:path) and its token
ids, each checked against the model's block_size."""

from typing import Any

from smallgpt.data import read_text
from smallgpt.errors import UserError
from smallgpt.tokenizer import encode_prompt


def read_prompts(start: str) -> list[str]:
    """The prompts --start gives: the text itself, FILE:path (one prompt) or LINES:path (one a
    line); the prefixes in any case."""
    kind, _, path = start.partition(":")
    kind = kind.upper()
    if kind not in ("FILE", "LINES"):
        return [start]
    if not path:
        raise UserError(f"--start={start} names no file: {kind}:path")
    text = read_text(path, "prompt file")
    if kind == "FILE":
        return [text]
    prompts = [line for line in text.splitlines() if line]
    if not prompts:
        raise UserError(
            f"prompt file {path} has no non-empty line: LINES: makes one prompt of each"
        )
    return prompts


def encode_prompts(tok: Any, prompts: list[str], block_size: int) -> list[list[int]]:
    """Each prompt's token ids, 1 to block_size of them, else a UserError."""
    ids = [encode_prompt(tok, p) for p in prompts]
    if not all(ids):
        raise UserError(
            "the prompt is empty: give it at least one character (--start=..., "
            "nanoGPT's default is a newline)"
        )
    too_long = [len(p) for p in ids if len(p) > block_size]
    if too_long:
        raise UserError(
            f"a prompt has {too_long[0]} tokens; it needs 1 to block_size={block_size} "
            f"(shorten it, or train with a larger block_size)"
        )
    return ids
