"""Each variant's best learning rate bracketed (compare.py --bracket=N): where a size x variant's
rate of lowest mean final val loss over its seeds is the lowest or the highest it trained at, all
its seeds train at one step of the --lrs grid further out, and again, up to N steps, until the rate
it is reported at has a worse one on each side. Which runs these are follows from the finished
runs' logs alone, so a stopped sweep resumes them and --mode=report reads the same runs."""

import dataclasses
import math
import statistics
from collections import defaultdict
from pathlib import Path

from smallgpt import sweep
from smallgpt.configs import CompareConfig, TrainConfig, label_rates
from smallgpt.runlog import read_run


def next_rate(edge: float, step: float, tried: list[float]) -> float:
    """edge times step (below 1: under the grid; above 1: over it), written with the fewest
    significant digits (1 to 3) that keep it at least half a step from every rate tried, as rates
    are written (1e-3 / 3 is 3e-4, 6e-3 x 2 is 1e-2); unrounded where none does."""
    exact = edge * step
    for digits in (1, 2, 3):
        rounded = float(f"{exact:.{digits}g}")
        if all(abs(math.log(rounded / t)) >= abs(math.log(step)) / 2 for t in tried):
            return rounded
    return exact


def final_val_loss(run: sweep.Run) -> float:
    """A finished run's final val loss; infinite where it diverged (its rate never chosen)."""
    logged = read_run(run.dir)
    return math.inf if logged["diverged"] else logged["evals"][-1]["val_loss"]


def grid_steps(cfg: CompareConfig) -> tuple[float, float]:
    """The factors one grid step below the lowest of --lrs and above the highest: the ratios of the
    two rates at each end."""
    lrs = sorted(set(cfg.lrs))
    return lrs[0] / lrs[1], lrs[-1] / lrs[-2]


def beyond(
    cfg: CompareConfig, base: TrainConfig, vocab_size: int, root: Path, runs: list[sweep.Run]
) -> list[sweep.Run]:
    """The runs one step past the edge for each size x variant of runs (all finished) whose chosen
    rate is the lowest or highest of those it trained at: every seed at that rate, as the grid's
    runs are made (Muon's rate, where --muon_lrs gives it apart, scaled alike)."""
    down, up = grid_steps(cfg)
    by_row = defaultdict(lambda: defaultdict(list))
    for run in runs:
        by_row[(run.size, run.name)][run.rate].append(final_val_loss(run))
    more = []
    for (size, name), losses in by_row.items():
        means = {label: statistics.fmean(ls) for label, ls in losses.items()}
        if min(means.values()) == math.inf:  # diverged at every rate: no choice to bracket
            continue
        chosen = min(means, key=means.get)
        lr, muon = label_rates(chosen)
        tried = [label_rates(label)[0] for label in means]
        if len(set(tried)) < 2 or min(tried) < lr < max(tried):
            continue
        new = next_rate(lr, down if lr == min(tried) else up, tried)
        at = dataclasses.replace(
            cfg, lrs=[new], muon_lrs=[] if muon is None else [muon * new / lr], bracket=0
        )
        more += [
            r for r in sweep.plan(at, base, vocab_size, root) if (r.size, r.name) == (size, name)
        ]
    return more


def plan(cfg: CompareConfig, base: TrainConfig, vocab_size: int, root: Path) -> list[sweep.Run]:
    """sweep.plan's runs, then up to cfg.bracket steps past each edge (beyond), as far as the
    finished runs decide them: a step is known once every run before it has finished."""
    runs = sweep.plan(cfg, base, vocab_size, root)
    for _ in range(cfg.bracket):
        if not all(map(sweep.finished, runs)):
            break
        more = beyond(cfg, base, vocab_size, root, runs)
        if not more:
            break
        runs += more
    return runs
