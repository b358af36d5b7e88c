"""Statistics over seeds for the comparison report: a mean with its Student t interval, the
seed-paired difference of two variants with its own interval, the ratio of two decode speeds over
their repeats with its interval, an accuracy pooled over seeds with its Wilson interval, the runs
that solved a recall task out of the seeds with a Clopper-Pearson interval, and the sentences that
say what they show.
"""

import math
import statistics
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Estimate:
    mean: float
    half_width: float | None  # of the 95% interval; None for fewer than 2 values
    n: int

    def text(self, signed: bool = False) -> str:
        """'1.5123 ± 0.0040' ('+0.0123 ± ...' signed); the mean alone without an interval."""
        return f"{self.mean:{'+' if signed else ''}.4f}" + (
            "" if self.half_width is None else f" ± {self.half_width:.4f}"
        )

    @property
    def excludes_zero(self) -> bool:
        return self.half_width is not None and abs(self.mean) > self.half_width


def t_quantile(df: int, level: float = 0.95) -> float:
    """The two-sided Student t critical value: t(1 - (1 - level) / 2, df)."""
    from scipy.stats import t

    return float(t.ppf(1 - (1 - level) / 2, df))


def mean_interval(values: list[float], level: float = 0.95) -> Estimate:
    """The mean and the half-width of its `level` interval, t(n - 1) * s / sqrt(n) (s: the sample
    deviation)."""
    n = len(values)
    if n == 0:
        raise ValueError("no values")
    if n < 2:
        return Estimate(values[0], None, 1)
    return Estimate(
        statistics.fmean(values),
        t_quantile(n - 1, level) * statistics.stdev(values) / math.sqrt(n),
        n,
    )


def paired_difference(
    a: dict[int, float], b: dict[int, float], level: float = 0.95
) -> Estimate | None:
    """a minus b, paired by seed (the seeds both have): the mean difference and its interval; None
    if none shared."""
    shared = sorted(a.keys() & b.keys())
    return mean_interval([a[s] - b[s] for s in shared], level) if shared else None


def proportion_interval(correct: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of the proportion correct / n: unlike a t interval, it stays inside
    [0, 1] at 0 or n correct (Wilson 1927, https://doi.org/10.1080/01621459.1927.10502953)."""
    from scipy.stats import binomtest

    interval = binomtest(correct, n).proportion_ci(confidence_level=level, method="wilson")
    return float(interval.low), float(interval.high)


@dataclass(frozen=True, slots=True)
class Accuracy:
    accuracy: float  # correct answers over answers, pooled over the seeds
    low: float  # its 95% Wilson interval
    high: float
    diff: Estimate | None  # the seed-paired difference of the per-seed accuracies to a reference's


def pooled_accuracy(
    results: dict[int, dict], reference: dict[int, dict], level: float = 0.95
) -> Accuracy:
    """The accuracy over {seed: result} (each result's "correct" of "n") pooled over the seeds with
    its Wilson interval, and the seed-paired difference of the per-seed accuracies to reference's
    (None without a seed in common)."""
    correct = sum(r["correct"] for r in results.values())
    n = sum(r["n"] for r in results.values())
    diff = paired_difference(
        {seed: r["correct"] / r["n"] for seed, r in results.items()},
        {seed: r["correct"] / r["n"] for seed, r in reference.items()},
        level,
    )
    return Accuracy(correct / n, *proportion_interval(correct, n, level), diff)


def exact_interval(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """The Clopper-Pearson ('exact') interval of the proportion k / n: the beta quantiles
    B(a/2; k, n - k + 1) and B(1 - a/2; k + 1, n - k), 0 at k = 0 and 1 at k = n (Clopper and
    Pearson 1934, https://doi.org/10.1093/biomet/26.4.404). For a count of runs, which are few,
    where Wilson's interval (proportion_interval) falls short of its level."""
    from scipy.stats import binomtest

    interval = binomtest(k, n).proportion_ci(confidence_level=level, method="exact")
    return float(interval.low), float(interval.high)


@dataclass(frozen=True, slots=True)
class Solved:
    k: int  # runs whose accuracy reached the threshold
    n: int  # runs
    low: float  # the 95% Clopper-Pearson interval of k / n
    high: float
    accuracy: float | None  # the mean accuracy of the k runs; None if none solved it

    def text(self) -> str:
        """'3/5 (0.147-0.947), acc 0.981': solved in k of n runs, the interval, their accuracy."""
        solved = "" if self.accuracy is None else f", acc {self.accuracy:.3f}"
        return f"{self.k}/{self.n} ({self.low:.3f}-{self.high:.3f}){solved}"


def solved(accuracies: list[float], threshold: float, level: float = 0.95) -> Solved:
    """How many runs (one accuracy each) solved a task, an accuracy of threshold or more, out of
    all, with the exact interval of that proportion, and the mean accuracy of those that did: what
    describes an all-or-nothing outcome, where a mean accuracy over the runs describes none of
    them."""
    won = [a for a in accuracies if a >= threshold]
    n = len(accuracies)
    accuracy = statistics.fmean(won) if won else None
    return Solved(len(won), n, *exact_interval(len(won), n, level), accuracy)


def verdict(name: str, reference: str, diff: Estimate | None) -> str:
    """One sentence on name's val loss against reference's, from their seed-paired difference."""
    if diff is None:
        return f"{name}: no seed in common with {reference}, so no paired comparison."
    if diff.half_width is None:
        return (
            f"{name}: {diff.mean:+.4f} nats against {reference} at 1 seed, with no interval: run "
            f"--seeds=3 or more to tell a difference from noise."
        )
    interval = "95% interval of the seed-paired difference"
    if diff.excludes_zero:
        side = "worse" if diff.mean > 0 else "better"
        return (
            f"{name} is {abs(diff.mean):.4f} ± {diff.half_width:.4f} nats {side} than "
            f"{reference} ({diff.n} seeds, {interval})."
        )
    return (
        f"{name}: no difference from {reference} detected at {diff.n} seeds ({diff.mean:+.4f} ± "
        f"{diff.half_width:.4f} nats; the {interval} includes 0)."
    )


@dataclass(frozen=True, slots=True)
class SpeedRatio:
    ratio: float  # a's speed over b's: the geometric mean of the per-repeat ratios
    low: float | None  # its 95% interval; None for fewer than 2 repeats
    high: float | None
    n: int

    @property
    def separated(self) -> bool:
        """Whether the repeats tell the speeds apart: the interval leaves out 1."""
        return self.low is not None and (self.low > 1 or self.high < 1)


def speed_ratio(a: list[float], b: list[float], level: float = 0.95) -> SpeedRatio | None:
    """a's speed over b's from their repeats, paired in order (compare.py measures repeat i of every
    shape in one round, so that drift hits both; unpaired repeats only widen the interval): the t
    interval of the mean log ratio, back on the ratio scale. None without a repeat of each."""
    n = min(len(a), len(b))
    if n == 0:
        return None
    est = mean_interval([math.log(x / y) for x, y in zip(a[:n], b[:n], strict=True)], level)
    if est.half_width is None:
        return SpeedRatio(math.exp(est.mean), None, None, n)
    return SpeedRatio(
        math.exp(est.mean),
        math.exp(est.mean - est.half_width),
        math.exp(est.mean + est.half_width),
        n,
    )


def speed_verdict(ratio: SpeedRatio, reference: str) -> str:
    """One sentence on a decode speed against reference's: a ratio only where the repeats separate
    the two."""
    if ratio.low is None:
        return (
            f"Its cached decode ran at {ratio.ratio:.2f}x {reference}'s speed in 1 repeat, with no "
            f"interval: measure with --speed_repeats=3 or more to tell a difference from noise."
        )
    interval = f"95% interval {ratio.low:.2f}-{ratio.high:.2f}x over {ratio.n} paired repeats"
    if ratio.separated:
        return f"Its cached decode ran at {ratio.ratio:.2f}x {reference}'s speed ({interval})."
    return (
        f"Its cached decode speed is within noise of {reference}'s (the ratio's {interval} "
        f"includes 1)."
    )
