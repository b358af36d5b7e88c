"""Multiple choice by log-likelihood, the way lm-evaluation-harness scores it, and two tasks of that
kind made from a dataset's own held-out text, so they run with no network.

An item is a few real lines of the dataset's test split (its val split where it has none) as the
context, then two choices: the next real line, and a wrong one. In "lines" the wrong one is the
same line with two of its tokens swapped (a check more than a benchmark: a trained model tells them
apart almost always); in "next_line" it is another real line from the lines that follow, so only
the context tells them apart. Both choices are the same number of tokens, and the true one is
first in every other item, so a model that cannot tell them apart (a constant one) scores exactly
50% on an even count.

The scorer (loglikelihoods) follows the harness's rules for a causal model, so the two can be held
against each other choice for choice (eval.py does, smallgpt/harness.py): the context's trailing
whitespace moves to the continuation, the continuation's tokens are those of context + continuation
after the context's own, and an input longer than the model's context is cut from the left.
"""

import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import numpy as np
import torch

from smallgpt.atomic import atomic_open
from smallgpt.data import open_tokens, splits_of
from smallgpt.errors import UserError
from smallgpt.recall import token_losses
from smallgpt.tokenizer import EOT

# The tasks by the names eval.py and compare.py take, each with its name in the harness
HARNESS_NAMES = {"lines": "smallgpt_lines", "next_line": "smallgpt_next_line"}
TASKS = tuple(HARNESS_NAMES)
NEARBY_LINES = 50  # next_line's wrong choice: one of the real lines this far after the true one
CONTEXT_LINES = 3  # the real lines before each item's choices
MIN_LINE_TOKENS = 4
MAX_LINE_TOKENS = 64  # at most, and at most half the model's context
# the split's first tokens that items are drawn from (enough lines for thousands of items)
TEXT_TOKENS = 1_000_000
SWAP_TRIES = 20  # swaps tried on a line before it is passed over

Encode = Callable[[str], list[int]]


def split_pair(
    encode: Encode, context: str, continuation: str, prefix: int | None = None
) -> tuple[list[int], list[int]]:
    """The context's tokens and the continuation's, as the harness makes them for a causal model:
    trailing whitespace of the context moves to the continuation, and the continuation's tokens are
    those of the whole text after the context's own. An empty context is the prefix token (the
    continuation's first token, where that is the prefix)."""
    if context == "":
        ids = encode(continuation)
        if prefix is None:
            raise UserError("a choice with an empty context needs a prefix token to condition on")
        return ([prefix], ids) if ids[0] != prefix else (ids[:1], ids[1:])
    kept = context.rstrip()
    if not kept:
        raise UserError("a choice's context is only whitespace: nothing to condition on")
    continuation = context[len(kept) :] + continuation
    whole = encode(kept + continuation)
    context_ids = encode(kept)
    return context_ids, whole[len(context_ids) :]


def prefix_token(tokenizer: object) -> int:
    """The token an empty context stands for: the end-of-text token, or for a tokenizer with none
    (char-level) a newline's, else token 0. The harness is given the same (harness.evaluate)."""
    eot = getattr(tokenizer, "eot_token", None)
    if eot is not None:
        return eot
    try:
        return tokenizer.encode("\n")[0]
    except UserError:  # a vocabulary without a newline
        return 0


@torch.no_grad()
def loglikelihoods(
    model: torch.nn.Module,
    encode: Encode,
    requests: list[tuple[str, str]],
    batch_size: int,
    prefix: int | None = None,
    amp: AbstractContextManager | None = None,
) -> list[float]:
    """The sum of the log-probabilities of each continuation given its context, for requests of
    (context, continuation), as the harness computes them: an input past the model's block_size is
    cut from the left (split_pair gives the tokens, prefix standing for an empty context). The model
    is put in eval mode and back."""
    block_size = model.config.block_size
    device = next(model.parameters()).device
    rows = []
    for context, continuation in requests:
        context_ids, continuation_ids = split_pair(encode, context, continuation, prefix)
        if not 0 < len(continuation_ids) <= block_size:
            raise UserError(
                f"a continuation of {len(continuation_ids)} tokens cannot be scored by a model of "
                f"block_size {block_size}"
            )
        # the last block_size + 1 tokens: block_size inputs, each predicting the next
        ids = (context_ids + continuation_ids)[-(block_size + 1) :]
        scored = len(continuation_ids)
        targets = [-1] * (len(ids) - 1 - scored) + ids[-scored:]
        rows.append((ids[:-1], targets))
    training = model.training
    model.eval()
    out = []
    try:
        for start in range(0, len(rows), batch_size):
            batch = rows[start : start + batch_size]
            width = max(len(inputs) for inputs, _ in batch)
            # padded on the right: a causal model's earlier positions never see the padding
            idx = torch.zeros(len(batch), width, dtype=torch.long)
            targets = torch.full((len(batch), width), -1, dtype=torch.long)
            for i, (inputs, wanted) in enumerate(batch):
                idx[i, : len(inputs)] = torch.tensor(inputs)
                targets[i, : len(wanted)] = torch.tensor(wanted)
            losses, _ = token_losses(model, idx.to(device), targets.to(device), amp)
            out += (-losses.double().nansum(dim=1)).tolist()
    finally:
        model.train(training)
    return out


def choice_scores(
    model: torch.nn.Module,
    encode: Encode,
    items: list[dict],
    batch_size: int,
    prefix: int | None = None,
    amp: AbstractContextManager | None = None,
) -> list[list[float]]:
    """Each item's log-likelihood of each of its choices (items: {context, choices, label})."""
    requests = [(item["context"], choice) for item in items for choice in item["choices"]]
    flat = loglikelihoods(model, encode, requests, batch_size, prefix, amp)
    scores = []
    for item in items:
        scores.append(flat[: len(item["choices"])])
        flat = flat[len(item["choices"]) :]
    return scores


def accuracy(scores: list[list[float]], labels: list[int]) -> tuple[int, int]:
    """(correct, n): the items whose highest-scored choice is the label, the first of equal scores
    counting as chosen (the harness's argmax)."""
    correct = sum(int(np.argmax(s)) == label for s, label in zip(scores, labels, strict=True))
    return correct, len(labels)


def items_from_dataset(
    data: Path, meta: dict, tokenizer: object, n: int, seed: int, block_size: int, task: str
) -> list[dict]:
    """Up to n items of task (one of TASKS; seeded) from the held-out split of the dataset in data
    (its meta.json and tokenizer), each line at most MAX_LINE_TOKENS tokens and half of
    block_size."""
    split = splits_of(meta)[-1]
    tokens = open_tokens(data, split, meta)[:TEXT_TOKENS]
    eot = getattr(tokenizer, "eot_token", None)
    # the documents of the split, which lines never cross
    ends = np.flatnonzero(tokens == eot) if eot is not None else np.array([], dtype=np.int64)
    documents = np.split(np.asarray(tokens, dtype=np.int64), ends)
    texts = [tokenizer.decode(doc[doc != eot].tolist()) for doc in documents]
    longest = min(MAX_LINE_TOKENS, block_size // 2)
    items = make_items(texts, tokenizer.encode, tokenizer.decode, n, seed, longest, task)
    if not items:
        raise UserError(
            f"the {split} split of {data} has no lines of {MIN_LINE_TOKENS} to {longest} tokens "
            f"after {CONTEXT_LINES} others: the {task} task needs line-structured text"
        )
    return items


def make_items(
    texts: list[str],
    encode: Encode,
    decode: Callable[[list[int]], str],
    n: int,
    seed: int,
    longest: int,
    task: str,
) -> list[dict]:
    """Up to n items of task from the lines of texts (documents), drawn in a seeded order: each
    line of MIN_LINE_TOKENS to longest tokens that has CONTEXT_LINES lines before it, against a
    wrong line of as many tokens: the line with two tokens swapped (lines: swap_two), or a later
    real line (next_line: nearby_line)."""
    rng = np.random.default_rng(seed)
    candidates = []
    for text in texts:
        lines = text.split("\n")
        for i in range(CONTEXT_LINES, len(lines)):
            if EOT not in lines[i] and lines[i].strip():
                candidates.append((lines, i))
    items = []
    for k in rng.permutation(len(candidates)):
        if len(items) == n:
            break
        lines, i = candidates[k]
        context = "\n".join(lines[i - CONTEXT_LINES : i])
        if EOT in context or not context.strip():
            continue
        true = "\n" + lines[i]
        count = len(split_pair(encode, context, true)[1])
        if not MIN_LINE_TOKENS <= count <= longest:
            continue
        if task == "lines":
            wrong = swap_two(encode, decode, context, lines[i], rng)
        else:
            wrong = nearby_line(encode, context, lines, i, count, rng)
        if wrong is None:
            continue
        # the true line first in every other item
        label = len(items) % 2
        choices = [true, "\n" + wrong] if label == 0 else ["\n" + wrong, true]
        items.append({"context": context, "choices": choices, "label": label})
    return items


def nearby_line(
    encode: Encode,
    context: str,
    lines: list[str],
    i: int,
    count: int,
    rng: np.random.Generator,
) -> str | None:
    """One of the NEARBY_LINES real lines after lines[i] (another text) that is count tokens after
    context, as lines[i] is, drawn at random; None if none is."""
    same_length = [
        line
        for line in lines[i + 1 : i + 1 + NEARBY_LINES]
        if line != lines[i]
        and line.strip()
        and EOT not in line
        and len(split_pair(encode, context, "\n" + line)[1]) == count
    ]
    return same_length[rng.integers(len(same_length))] if same_length else None


def swap_two(
    encode: Encode,
    decode: Callable[[list[int]], str],
    context: str,
    line: str,
    rng: np.random.Generator,
) -> str | None:
    """line with two of its tokens (different ones) swapped, scored as as many tokens after context
    as the line itself; None if SWAP_TRIES draws find no such swap."""
    ids = encode(line)
    if len(set(ids)) < 2:
        return None
    count = len(split_pair(encode, context, "\n" + line)[1])
    for _ in range(SWAP_TRIES):
        i, j = sorted(rng.choice(len(ids), size=2, replace=False).tolist())
        if ids[i] == ids[j]:
            continue
        swapped_ids = list(ids)
        swapped_ids[i] = ids[j]
        swapped_ids[j] = ids[i]
        swapped = decode(swapped_ids)
        if swapped == line or EOT in swapped or "\n" in swapped:
            continue
        if len(split_pair(encode, context, "\n" + swapped)[1]) == count:
            return swapped
    return None


def write_task(folder: Path, items: list[dict], task: str) -> Path:
    """items as task (one of TASKS) of lm-evaluation-harness in folder: its YAML (a local json
    dataset, scored by accuracy, the choice right after the context) and its items, one JSON object
    a line; datasets caches what it reads of them in folder too. Returns the YAML's path."""
    name = HARNESS_NAMES[task]
    data = folder / f"{name}.jsonl"
    with atomic_open(data, "w") as f:
        for item in items:
            f.write(json.dumps(item) + "\n")
    # doc_to_*: field names, which the harness reads as they are (no template)
    yaml = "\n".join(
        [
            f"task: {name}",
            "dataset_path: json",
            "dataset_kwargs:",
            "  data_files:",
            f"    test: {json.dumps(str(data.resolve()))}",
            # datasets' cache of it beside it, not in the user's cache
            f"  cache_dir: {json.dumps(str((folder / 'cache' / task).resolve()))}",
            "output_type: multiple_choice",
            "test_split: test",
            "doc_to_text: context",
            "doc_to_choice: choices",
            "doc_to_target: label",
            'target_delimiter: ""',
            "metric_list:",
            "  - metric: acc",
            "    aggregation: mean",
            "    higher_is_better: true",
            "metadata:",
            "  version: 1.0",
            "",
        ]
    )
    path = folder / f"{name}.yaml"
    with atomic_open(path, "w") as f:
        f.write(yaml)
    return path
