"""Recall capacity curves (docs/compare.md, issue 88): for each variant, MQAR accuracy against the
number of key-value pairs at one width, each cell at the variant's best learning rate there, and
the curve's knee, the largest pair count the variant recalls in every seed. Zoology (arXiv
2312.04927) reads its verdicts from where such curves bend, not from how many seeds of one hard
setting escape a plateau: a knee that moves with the share of attention is a resolved verdict
where a solved count of 1/5 against 3/5 is not.

Everything here is computed from per-run results (a variant, a pair count, a seed, a rate, the
val accuracy that chooses the rate and the test accuracy reported: `Result`; `results_of` reads
them from a comparison's runs), which `write_results` and `read_results` keep as a small CSV, so a
table is regenerated from committed files without training, and a protocol started on one machine
goes on on another."""

import csv
import dataclasses
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from smallgpt import stats
from smallgpt.atomic import atomic_open
from smallgpt.errors import UserError

COLUMNS = ("variant", "size", "pairs", "seed", "lr", "val_accuracy", "accuracy")


@dataclass(frozen=True, slots=True)
class Result:
    """One training run's MQAR accuracy on the examples of one pair count."""

    variant: str
    pairs: int  # key-value pairs an example holds
    seed: int
    lr: float
    val_accuracy: float  # what the rate is chosen on
    accuracy: float  # on the test split: what is reported
    size: str = ""  # the model's layers x width ("4x64"): a protocol's parts may differ in it


@dataclass(frozen=True, slots=True)
class Cell:
    """A variant's runs at one pair count, at the rate chosen for it."""

    pairs: int
    lr: float  # the rate of the highest mean val accuracy over the seeds (ties: the lower rate)
    # a rate tried below and one above, each of a lower mean val accuracy: the best is inside the
    # rates tried, not at their edge
    bracketed: bool
    seeds: tuple[int, ...]
    accuracies: tuple[float, ...]  # test, by seed, in the order of seeds
    solved: stats.Solved  # the seeds whose accuracy reached the threshold, with its interval


@dataclass(frozen=True, slots=True)
class Knee:
    """Where a curve bends: every seed solved every measured pair count up to `pairs` (None: not
    the smallest), and at `next_pairs`, the next measured count, some seed did not (None: none
    failed, the knee is at or past the largest count measured). The capacity lies in [pairs,
    next_pairs): that range is the knee's interval."""

    pairs: int | None
    next_pairs: int | None
    how: str  # how it was found, in words


def best_cell(runs: list[Result], threshold: float) -> Cell:
    """The cell of one variant's runs at one pair count: the rate of the highest mean val accuracy
    (ties to the lower rate), whether a worse rate lies on each side of it, and its seeds' test
    accuracies."""
    by_rate: dict[float, list[Result]] = {}
    for run in runs:
        by_rate.setdefault(run.lr, []).append(run)
    mean = {lr: statistics.fmean(r.val_accuracy for r in rs) for lr, rs in by_rate.items()}
    lr = max(sorted(mean), key=lambda rate: mean[rate])  # max keeps the first of equals
    below = [rate for rate in mean if rate < lr]
    above = [rate for rate in mean if rate > lr]
    bracketed = any(mean[r] < mean[lr] for r in below) and any(mean[r] < mean[lr] for r in above)
    chosen = sorted(by_rate[lr], key=lambda r: r.seed)
    accuracies = tuple(r.accuracy for r in chosen)
    return Cell(
        pairs=chosen[0].pairs,
        lr=lr,
        bracketed=bracketed,
        seeds=tuple(r.seed for r in chosen),
        accuracies=accuracies,
        solved=stats.solved(list(accuracies), threshold),
    )


def sized(results: Iterable[Result]) -> list[Result]:
    """The results, each variant named by its size too ("8x64 mha") where they hold more than one
    size: the same variant at two depths is two curves, not one."""
    results = list(results)
    if len({r.size for r in results}) < 2:
        return results
    return [dataclasses.replace(r, variant=f"{r.size} {r.variant}") for r in results]


def curves(results: Iterable[Result], threshold: float) -> dict[str, list[Cell]]:
    """Each variant's curve, its cells in order of pair count (variants in order of appearance)."""
    runs: dict[str, dict[int, list[Result]]] = {}
    for result in results:
        runs.setdefault(result.variant, {}).setdefault(result.pairs, []).append(result)
    return {
        variant: [best_cell(by_pairs[p], threshold) for p in sorted(by_pairs)]
        for variant, by_pairs in runs.items()
    }


def knee(cells: list[Cell]) -> Knee:
    """The largest pair count up to which every seed solved every measured count, the next
    count measured, and how they were found (a count solved again past the first failure is
    named, and not counted: the knee is where the curve first falls)."""
    solved_all = [c.solved.k == c.solved.n for c in cells]
    first_fail = solved_all.index(False) if False in solved_all else len(cells)
    pairs = cells[first_fail - 1].pairs if first_fail > 0 else None
    if first_fail == len(cells):
        return Knee(pairs, None, f"every seed solved every count measured, up to {pairs}")
    failed = cells[first_fail]
    at = f"{failed.pairs} pairs solved in {failed.solved.k}/{failed.solved.n} seeds"
    how = f"every seed solved up to {pairs}; {at}" if pairs is not None else f"{at}, the smallest"
    again = [c.pairs for c in cells[first_fail + 1 :] if c.solved.k == c.solved.n]
    if again:
        how += f" (solved by every seed again at {', '.join(map(str, again))}: not counted)"
    return Knee(pairs, failed.pairs, how)


def knees_differ(a: Knee, b: Knee) -> bool:
    """Whether two knees' intervals [pairs, next_pairs) leave each other out: one variant's
    capacity is below the count where the other's is known to reach."""

    def below(x: Knee, y: Knee) -> bool:  # x's capacity is short of what y solved everywhere
        return x.next_pairs is not None and y.pairs is not None and x.next_pairs <= y.pairs

    return below(a, b) or below(b, a)


def table(by_variant: dict[str, list[Cell]]) -> str:
    """The curves as markdown: a row per variant and pair count (its rate, whether bracketed, the
    accuracy by seed, the solved k/n with its interval), and each variant's knee."""
    lines = [
        "| variant | pairs | rate | bracketed | accuracy by seed | solved (95% CI) |",
        "|---|---|---|---|---|---|",
    ]
    for variant, cells in by_variant.items():
        for c in cells:
            by_seed = ", ".join(f"{s}: {a:.3f}" for s, a in zip(c.seeds, c.accuracies, strict=True))
            edge = "yes" if c.bracketed else "no (at the edge of the rates tried)"
            lines.append(
                f"| {variant} | {c.pairs} | {c.lr:g} | {edge} | {by_seed} | {c.solved.text()} |"
            )
    lines += [
        "",
        "| variant | knee (pairs solved in every seed) | next count | how |",
        "|---|---|---|---|",
    ]
    for variant, cells in by_variant.items():
        k = knee(cells)
        at = "-" if k.pairs is None else str(k.pairs)
        after = "-" if k.next_pairs is None else str(k.next_pairs)
        lines.append(f"| {variant} | {at} | {after} | {k.how} |")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True, slots=True)
class RateRow:
    """A variant's runs at one rate, over every pair count: how the rate did, whatever count it is
    chosen at."""

    variant: str
    lr: float
    pairs: int  # the smallest count measured: the one every run that learns anything learns first
    val_accuracy: float  # the mean over the seeds of the val accuracy at `pairs`
    solved: int  # the seeds whose test accuracy reached the threshold at every count
    seeds: int


def by_rate(results: Iterable[Result], threshold: float) -> list[RateRow]:
    """Each variant's rates (variants in order of appearance, rates rising): where the rate search
    stands, what a bracket rests on."""
    runs: dict[str, dict[float, dict[int, list[Result]]]] = {}
    for r in results:
        runs.setdefault(r.variant, {}).setdefault(r.lr, {}).setdefault(r.seed, []).append(r)
    rows = []
    for variant, rates in runs.items():
        for lr in sorted(rates):
            seeds = rates[lr]
            pairs = min(r.pairs for rs in seeds.values() for r in rs)
            at_pairs = [r.val_accuracy for rs in seeds.values() for r in rs if r.pairs == pairs]
            solved = sum(all(r.accuracy >= threshold for r in rs) for rs in seeds.values())
            rows.append(RateRow(variant, lr, pairs, statistics.fmean(at_pairs), solved, len(seeds)))
    return rows


def rates_table(rows: list[RateRow]) -> str:
    """by_rate's rows as markdown, a row per variant and a column per rate: the mean val accuracy
    at the smallest count, and the seeds that solved every count ('-': the rate not tried)."""
    rates = sorted({r.lr for r in rows})
    cells = {(r.variant, r.lr): r for r in rows}
    lines = [
        "| variant | " + " | ".join(f"{lr:g}" for lr in rates) + " |",
        "|---|" + "---|" * len(rates),
    ]
    for variant in dict.fromkeys(r.variant for r in rows):
        tried = [cells.get((variant, lr)) for lr in rates]
        entries = [f"{c.val_accuracy:.3f} ({c.solved}/{c.seeds})" if c else "-" for c in tried]
        lines.append(f"| {variant} | " + " | ".join(entries) + " |")
    return "\n".join(lines) + "\n"


def section(by_variant: dict[str, list[Cell]], threshold: float, csv_name: str) -> str:
    """report.md's capacity section: what the table is, then table()."""
    return (
        "\n## Capacity: MQAR accuracy by pair count\n\n"
        "Each variant's test accuracy on the examples of each pair count, at the rate of the "
        "highest mean val accuracy there (bracketed: a worse rate tried on each side); solved: "
        f"accuracy at least {threshold:g}, with its 95% Clopper-Pearson interval. The knee: the "
        "largest count solved in every seed; the capacity lies below the next count measured. "
        f"Each run's results: {csv_name}.\n\n" + table(by_variant)
    )


def write_results(path: Path, results: Iterable[Result]) -> None:
    """The per-run results as CSV (COLUMNS), whole or not at all."""
    with atomic_open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        for r in results:
            writer.writerow(
                [
                    r.variant,
                    r.size,
                    r.pairs,
                    r.seed,
                    repr(r.lr),
                    repr(r.val_accuracy),
                    repr(r.accuracy),
                ]
            )


def read_results(path: Path) -> list[Result]:
    """The per-run results write_results kept; a UserError for a file that is not such a CSV."""
    try:
        with open(path, newline="") as f:
            return [
                Result(
                    row["variant"],
                    int(row["pairs"]),
                    int(row["seed"]),
                    float(row["lr"]),
                    float(row["val_accuracy"]),
                    float(row["accuracy"]),
                    row["size"],
                )
                for row in csv.DictReader(f)
            ]
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except (KeyError, TypeError, ValueError, UnicodeDecodeError, csv.Error) as e:
        raise UserError(
            f"{path} is not a capacity.csv of per-run results (columns {', '.join(COLUMNS)}): "
            f"{type(e).__name__} {e}"
        ) from None


def results_of(runs: list[dict]) -> list[Result]:
    """The per-run results of a comparison's runs (report.read_runs's records) trained on a mix of
    pair counts (data/mqar --pairs_mix): each run's test accuracy by pair count (its final
    evaluation's MQAR task) and val accuracy (its final evaluation's val_mqar), with its size. A run
    that diverged recalls nothing: 0 at every pair count the others measured."""
    measured = [r for r in runs if not r["diverged"] and by_pairs(r)]
    counts = sorted({p for r in measured for p in by_pairs(r)})
    out = []
    for r in runs:
        if not r["diverged"] and not by_pairs(r):
            continue
        lr = float(r["rate"]) if r["rate"] is not None else r["config"]["learning_rate"]
        test = by_pairs(r)
        val = {} if r["diverged"] else val_by_pairs(r)
        for p in counts if r["diverged"] else sorted(test):
            out.append(
                Result(
                    r["variant"],
                    p,
                    r["seed"],
                    lr,
                    val_accuracy=val.get(p, 0.0),
                    accuracy=test.get(p, 0.0),
                    size=r["size"],
                )
            )
    return out


def by_pairs(run: dict) -> dict[int, float]:
    """A run's test accuracy by pair count ({} where its final evaluation measured none)."""
    mqar = (run.get("recall") or {}).get("mqar") or {}
    return {c["pairs"]: c["accuracy"] for c in mqar.get("by_pairs", [])}


def val_by_pairs(run: dict) -> dict[int, float]:
    """A run's val accuracy by pair count at its final evaluation."""
    final = run["evals"][-1] if run["evals"] else {}
    return {c["pairs"]: c["accuracy"] for c in final.get("val_mqar", {}).get("by_pairs", [])}
