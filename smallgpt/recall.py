"""What attention is for, measured on any model this project loads: induction (copying a random
segment seen earlier, Olsson et al. 2022, arXiv 2209.11895), the loss at each position of the
context, multi-query associative recall on an MQAR dataset (data/mqar, Zoology: Arora et al.
2023, arXiv 2312.04927), and in that dataset's tokens a needle at each depth and MQAR at up to 8x
the trained context (smallgpt/long_recall.py). eval.py is the command; train.py runs the tasks of
--final_evals at its final evaluation. Figures: docs/compare.md."""

from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext

import numpy as np
import torch
from torch.nn import functional as F
from tqdm import tqdm

from smallgpt import long_recall
from smallgpt.data import Batches
from smallgpt.errors import UserError

TASKS = ("induction", "position", "mqar", "needle", "mqar_long")
# the tasks that read an MQAR dataset: its examples, or its tokens and shape
MQAR_TASKS = ("mqar", "needle", "mqar_long")
# the tasks that read past block_size (long_recall.stretched)
LONG_TASKS = ("needle", "mqar_long")


def task_problems(key: str, tasks: list[str]) -> list[str]:
    """What is wrong with a list of task names given as key (a config's check)."""
    return [
        f"{key}: {task!r} is not one of {', '.join(TASKS)}" for task in tasks if task not in TASKS
    ]


@torch.no_grad()
def check_dataset(tasks: list[str], meta: dict, block_size: int, where: str) -> None:
    """A UserError, before any training, for a task that a model of block_size on the dataset of
    meta (at where) cannot run: mqar, needle or mqar_long on a dataset that is not MQAR, induction
    with too few tokens or too short a context."""
    check_mqar(tasks, meta, where)
    if "induction" in tasks:
        length = default_length(block_size)
        if length < 2:
            raise UserError(
                f"the induction task copies a quarter of the context, at least 2 tokens, so it "
                f"needs block_size >= 8, not {block_size}: leave induction out of the tasks"
            )
        # said here of the run's keys, not of eval.py's induction_length
        if meta["vocab_size"] < 2 * length:
            raise UserError(
                f"the induction task copies a segment of {length} tokens (a quarter of "
                f"block_size, at most 16), which needs {2 * length} distinct tokens (the "
                f"segment's and as many for the filler), but the vocabulary has "
                f"{meta['vocab_size']}: leave induction out of the tasks, or lower block_size"
            )


def check_mqar(tasks: list[str], meta: dict, where: str) -> None:
    """A UserError where some of tasks read an MQAR dataset (MQAR_TASKS) and meta is not one's (its
    examples have a fixed length), naming those tasks."""
    readers = [task for task in tasks if task in MQAR_TASKS]
    if not readers:
        return
    names = " and ".join([", ".join(readers[:-1]), readers[-1]] if len(readers) > 2 else readers)
    reads = "task reads" if len(readers) == 1 else "tasks read"
    require_mqar(meta, where, f"the {names} {reads}", f"{names} out of the tasks")


def require_mqar(meta: dict, where: str, reader: str, leave: str) -> None:
    """A UserError where meta (of the dataset at where) is not an MQAR dataset's, for what reads one
    (reader, e.g. 'the mqar task reads') and what the user may leave out instead."""
    if meta.get("example_tokens"):
        return
    raise UserError(
        f"{reader} an MQAR dataset (python data/mqar/prepare.py), and {where} is not one (its "
        f"meta.json records no example_tokens): give --dataset=<an MQAR dataset>, or leave "
        f"{leave}"
    )


def default_length(block_size: int) -> int:
    """Induction's segment when none is given: 16 tokens, or a quarter of the context."""
    return min(16, block_size // 4)


def token_losses(
    model: torch.nn.Module,
    idx: torch.Tensor,
    targets: torch.Tensor,
    amp: AbstractContextManager | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position's loss and whether the model's top token is the target, both (B, T) and on CPU,
    for inputs idx (B, T) and targets (B, T); a target of -1 (nothing to predict there) gets a NaN
    loss and counts as wrong."""
    with amp or nullcontext():
        # (B, T, vocab_size): with targets the model returns every position's
        logits, _ = model(idx, targets)
    logits = logits.float()
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten().clamp(min=0), reduction="none")
    loss = loss.view_as(targets).masked_fill(targets < 0, float("nan"))
    correct = (logits.argmax(-1) == targets) & (targets >= 0)
    return loss.cpu(), correct.cpu()


def default_distances(block_size: int, length: int) -> list[int]:
    """Distances from length up to the longest that fits block_size, doubling: 16, 32, ...,
    block_size - length."""
    longest = block_size - length
    distances = []
    d = length
    while d < longest:
        distances.append(d)
        d *= 2
    return distances + [longest] if longest >= length else []


def check_induction(block_size: int, vocab: int, length: int, distances: list[int]) -> None:
    """A UserError for an induction task this model cannot take: too few tokens, or a distance past
    block_size."""
    if length < 2:
        raise UserError(f"induction_length={length}: a copied segment needs at least 2 tokens")
    if vocab < 2 * length:
        raise UserError(
            f"induction_length={length} needs {2 * length} distinct tokens (the segment's and as "
            f"many for the filler), but the vocabulary has {vocab}: lower induction_length"
        )
    for d in distances:
        if not length <= d <= block_size - length:
            raise UserError(
                f"induction distance {d} with induction_length={length}: each distance must be "
                f"between {length} and block_size - {length} = {block_size - length}, so that the "
                f"copy fits the context"
            )


def induction_batch(
    rng: np.random.Generator, batch: int, vocab: int, length: int, distance: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (batch, distance + length - 1): a segment of `length` distinct random
    tokens, filler of other random tokens up to `distance`, then the segment again; the targets are
    the copy's tokens after its first (the ones an induction head predicts), -1 elsewhere."""
    rows = []
    for _ in range(batch):
        segment = rng.choice(vocab, size=length, replace=False)
        others = np.setdiff1d(np.arange(vocab), segment)
        filler = rng.choice(others, size=distance - length)
        rows.append(np.concatenate([segment, filler, segment]))
    seq = torch.from_numpy(np.stack(rows).astype(np.int64))  # (B, distance + length)
    targets = seq[:, 1:].clone()
    # before the copy's second token nothing is predictable from the context
    targets[:, :distance] = -1
    return seq[:, :-1], targets


def induction(
    model: torch.nn.Module,
    vocab: int,
    distances: list[int],
    length: int = 16,
    examples: int = 256,
    batch_size: int = 32,
    seed: int = 0,
    device: str | torch.device = "cpu",
    amp: AbstractContextManager | None = None,
    progress: bool = False,
) -> list[dict]:
    """At each distance: the mean loss, the top-1 accuracy and the number of predictions on the
    second copy of a random segment (induction_batch), over `examples` sequences drawn from the
    first `vocab` token ids with seed."""
    check_induction(model.config.block_size, vocab, length, distances)
    out = []
    for distance in distances:
        rng = np.random.default_rng([seed, distance])
        losses = []
        hits = []
        for b in batches_of(examples, batch_size, f"induction at {distance}", progress):
            idx, targets = induction_batch(rng, b, vocab, length, distance)
            loss, correct = token_losses(model, idx.to(device), targets.to(device), amp)
            keep = targets >= 0
            losses.append(loss[keep])
            hits.append(correct[keep])
        loss = torch.cat(losses)
        hit = torch.cat(hits)

        out.append(
            {
                "distance": distance,
                "loss": loss.mean().item(),
                "accuracy": hit.float().mean().item(),
                "correct": int(hit.sum()),
                "n": hit.numel(),
            }
        )
    return out


def loss_by_position(
    model: torch.nn.Module,
    batches: Batches,
    eval_iters: int,
    amp: AbstractContextManager | None = None,
    progress: bool = False,
    split: str = "val",
) -> list[float | None]:
    """The mean loss at each context position 0..block_size-1 over the split's eval_iters
    evaluation batches (the ones train.py's loss on that split averages); None where no target
    counts (an MQAR dataset's non-answers)."""
    total = torch.zeros(batches.block_size, dtype=torch.float64)
    count = torch.zeros(batches.block_size, dtype=torch.float64)
    for k in tqdm(range(eval_iters), desc="loss by position", disable=not progress):
        loss, _ = token_losses(model, *batches.eval(split, k), amp)
        known = ~loss.isnan()
        total += torch.where(known, loss, 0.0).sum(0)
        count += known.sum(0)
    return [t / c if c else None for t, c in zip(total.tolist(), count.tolist(), strict=True)]


def mqar(
    model: torch.nn.Module,
    batches: Batches,
    eval_iters: int,
    amp: AbstractContextManager | None = None,
    progress: bool = False,
    split: str = "val",
) -> dict:
    """Exact-match accuracy on the answers of an MQAR dataset's examples of split (its eval_iters
    evaluation batches): the top token at each answer position is the value of the key just
    queried. A dataset of a mix of pair counts (data/mqar --pairs_mix, every key asked) also gets
    by_pairs: the accuracy of its examples of each count (an example's answers are its pairs)."""
    check_mqar(["mqar"], batches.meta, str(batches.path))
    mixed = bool(batches.meta.get("settings", {}).get("pairs_mix"))
    correct: dict[int, int] = {}  # by the number of answers an example holds
    n: dict[int, int] = {}
    for k in tqdm(range(eval_iters), desc="mqar", disable=not progress):
        idx, targets = batches.eval(split, k)
        _, hit = token_losses(model, idx, targets, amp)
        asked = (targets >= 0).cpu()
        answers = asked.sum(1)
        hits = (hit & asked).sum(1)
        for count in answers.unique().tolist():
            rows = answers == count
            correct[count] = correct.get(count, 0) + int(hits[rows].sum())
            n[count] = n.get(count, 0) + count * int(rows.sum())
    total = sum(n.values())
    out = {"accuracy": sum(correct.values()) / total, "correct": sum(correct.values()), "n": total}
    if mixed:
        out["by_pairs"] = [
            {"pairs": p, "accuracy": correct[p] / n[p], "correct": correct[p], "n": n[p]}
            for p in sorted(n)
        ]
    return out


def weakest(result: dict) -> float:
    """An MQAR result's accuracy where it is lowest: on a mix of pair counts the count recalled
    worst (an early stop on the whole would stop with the hardest count short of it), else the
    whole."""
    return min((c["accuracy"] for c in result.get("by_pairs", [])), default=result["accuracy"])


def solved_rows(
    model: torch.nn.Module,
    idx: torch.Tensor,
    targets: torch.Tensor,
    amp: AbstractContextManager | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per example, whether every answer (a target not -1) is the model's top token, and per
    answer whether it is; on CPU."""
    _, correct = token_losses(model, idx, targets, amp)
    asked = targets.cpu() >= 0
    return (correct | ~asked).all(1), correct[asked]


@torch.no_grad()
def needle(
    model: torch.nn.Module,
    vocab: long_recall.Vocab,
    lengths: list[int],
    depths: list[float],
    span: int = 1,
    examples: int = 256,
    batch_size: int = 32,
    seed: int = 0,
    amp: AbstractContextManager | None = None,
) -> list[dict]:
    """Solved k/n of `examples` needles (long_recall.needle_batch) at each length and depth."""
    long_recall.check_lengths(model.config, lengths)  # before any work
    device = next(model.parameters()).device
    out = []
    for length in lengths:
        longer = long_recall.stretched(model, length)
        for depth in depths:
            rng = np.random.default_rng([seed, length, round(depth * 1000), span])
            k = 0
            for b in batches_of(examples, batch_size, f"needle at {length}, {depth:g}", False):
                idx, targets = long_recall.needle_batch(rng, b, length, depth, vocab, span)
                rows, _ = solved_rows(longer, idx.to(device), targets.to(device), amp)
                k += int(rows.sum())
            out.append(long_recall.cell(k, examples, length=length, depth=depth, span=span))
    return out


@torch.no_grad()
def mqar_long(
    model: torch.nn.Module,
    vocab: long_recall.Vocab,
    lengths: list[int],
    examples: int = 256,
    batch_size: int = 32,
    seed: int = 0,
    amp: AbstractContextManager | None = None,
) -> list[dict]:
    """Solved k/n of `examples` MQAR examples (long_recall.mqar_batch: every query answered) at
    each length, with the accuracy over single answers."""
    long_recall.check_lengths(model.config, lengths)  # before any work
    device = next(model.parameters()).device
    out = []
    for length in lengths:
        longer = long_recall.stretched(model, length)
        rng = np.random.default_rng([seed, length])
        k = hits = answers = 0
        for b in batches_of(examples, batch_size, f"mqar at {length}", False):
            idx, targets = long_recall.mqar_batch(rng, b, length, vocab)
            rows, each = solved_rows(longer, idx.to(device), targets.to(device), amp)
            k += int(rows.sum())
            hits += int(each.sum())
            answers += each.numel()
        out.append(long_recall.cell(k, examples, length=length) | {"accuracy": hits / answers})
    return out


def batches_of(total: int, size: int, what: str, progress: bool) -> Iterator[int]:
    """The batch sizes that make up total, with a progress bar if asked."""
    sizes = [min(size, total - start) for start in range(0, total, size)]
    return iter(tqdm(sizes, desc=what, disable=not progress))


def run_tasks(
    tasks: list[str],
    model: torch.nn.Module,
    batches: Batches | None,
    eval_iters: int,
    vocab: int | None = None,
    distances: list[int] | None = None,
    length: int | None = None,
    examples: int = 256,
    batch_size: int = 32,
    seed: int = 0,
    amp: AbstractContextManager | None = None,
    progress: bool = False,
    split: str = "val",
    lengths: list[int] | None = None,
    depths: list[float] | None = None,
    span: int = 1,
) -> dict:
    """{task: its result} for each of tasks (TASKS) on the model's device. batches: the dataset's
    (position and mqar read its split; needle and mqar_long its tokens); vocab: the token ids
    induction draws from (default: the dataset's vocab_size); length: induction's segment, by
    default 16 tokens or a quarter of the context; lengths, depths and span: needle's and
    mqar_long's (long_recall's defaults: 1x to 8x block_size, depths 0 to 1, one token). The model
    is put in eval mode and back."""
    problems = task_problems("tasks", tasks)
    if problems:
        raise UserError(problems[0])
    device = next(model.parameters()).device
    training = model.training
    model.eval()
    out = {}
    try:
        if "induction" in tasks:
            length = length or default_length(model.config.block_size)
            if distances is None:
                distances = default_distances(model.config.block_size, length)
            vocab = vocab or batches.meta["vocab_size"]
            out["induction"] = induction(
                model, vocab, distances, length, examples, batch_size, seed, device, amp, progress
            )
        if "position" in tasks:
            out["position"] = loss_by_position(model, batches, eval_iters, amp, progress, split)
        if "mqar" in tasks:
            out["mqar"] = mqar(model, batches, eval_iters, amp, progress, split)
        if any(task in LONG_TASKS for task in tasks):
            out |= long_tasks(
                tasks, model, batches, lengths, depths, span, examples, batch_size, seed, amp
            )
    finally:
        model.train(training)
    return out


def long_tasks(
    tasks: list[str],
    model: torch.nn.Module,
    batches: Batches,
    lengths: list[int] | None,
    depths: list[float] | None,
    span: int,
    examples: int,
    batch_size: int,
    seed: int,
    amp: AbstractContextManager | None,
) -> dict:
    """needle's and mqar_long's results (long_recall), in the MQAR dataset's tokens."""
    check_mqar(tasks, batches.meta, str(batches.path))
    vocab = long_recall.Vocab.of(batches.meta, str(batches.path))
    lengths = lengths or long_recall.default_lengths(model.config.block_size)
    out = {}
    if "needle" in tasks:
        depths = list(long_recall.DEPTHS) if depths is None else depths
        out["needle"] = needle(model, vocab, lengths, depths, span, examples, batch_size, seed, amp)
    if "mqar_long" in tasks:
        out["mqar_long"] = mqar_long(model, vocab, lengths, examples, batch_size, seed, amp)
    return out


def flat(results: dict) -> dict[str, float]:
    """run_tasks's results as named numbers (a wandb summary): induction_acc@16, induction_loss@16,
    ..., mqar_acc (and mqar_acc@<pairs> on a mix of pair counts); position_loss_first and
    position_loss_last (the first and last positions with a target); needle_solved@<length>@<depth>
    and mqar_long_solved@<length> (the solved share)."""
    out = {}
    for r in results.get("induction", []):
        out[f"induction_acc@{r['distance']}"] = r["accuracy"]
        out[f"induction_loss@{r['distance']}"] = r["loss"]
    known = [loss for loss in results.get("position", []) if loss is not None]
    if known:
        out |= {"position_loss_first": known[0], "position_loss_last": known[-1]}
    if "mqar" in results:
        out["mqar_acc"] = results["mqar"]["accuracy"]
        for r in results["mqar"].get("by_pairs", []):
            out[f"mqar_acc@{r['pairs']}"] = r["accuracy"]
    for r in results.get("needle", []):
        out[f"needle_solved@{r['length']}@{r['depth']:g}"] = r["rate"]
    for r in results.get("mqar_long", []):
        out[f"mqar_long_solved@{r['length']}"] = r["rate"]
    return out


def summary_line(results: dict) -> str:
    """One line of run_tasks's results, as train.py prints them: flat's numbers."""
    return ", ".join(
        f"{name.replace('_', ' ')} {value:.3f}" for name, value in flat(results).items()
    )
