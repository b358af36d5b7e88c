"""report.png for the attention-variant comparison (smallgpt/report.py): val loss by iteration, the
gap to MHA against size, val loss against the learning rate (--lrs), conversions by uptraining
and, for runs trained with --final_evals, the loss by context position and the induction accuracy
by distance (MQAR beside it), and the capacity curves of runs trained on a mix of MQAR pair
counts.
"""

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from smallgpt.atomic import atomic_open
from smallgpt.capacity import Cell


def losses_by_rate(row: dict) -> dict[str, str]:
    """A row's val_loss_by_lr as {rate: mean final val loss, as written ('inf': a seed
    diverged)}."""
    return dict(pair.rsplit(":", 1) for pair in row["val_loss_by_lr"].split())


def conversion_target(row: dict) -> str:
    """The variant a conversion makes: 'mha-to-mqa-first-u0.1' -> 'mqa', and a hybrid's
    'mha-to-mha-dddl-copy-u0.05-kl' -> 'mha-dddl'."""
    name = row["variant"].removeprefix("mha-to-")
    return name[: name.rindex(f"-{row['method']}-u")]


def plot(
    runs: list[dict], rows: list[dict], path: Path, curves: dict[str, list[Cell]] | None = None
) -> None:
    """report.png: a panel per view the runs and rows hold data for, three to a line; curves:
    the capacity curves (smallgpt/capacity.py), where the runs trained on a mix of pair counts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scratch_runs = [r for r in runs if not r["method"]]
    scratch_rows = [r for r in rows if not r["method"]]
    conv = [r for r in rows if r["method"]]
    recalls = [r["recall"] or {} for r in scratch_runs]
    # the panels there is data for, each a function drawing on its axes
    panels = [lambda ax: loss_panel(ax, scratch_runs), lambda ax: gap_panel(ax, rows)]
    if any(r.get("val_loss_by_lr") for r in scratch_rows):
        panels.append(lambda ax: rate_panel(ax, scratch_rows))
    if conv:
        panels.append(lambda ax: conversion_panel(ax, conv))
    if any(recall.get("position") for recall in recalls):
        panels.append(lambda ax: position_panel(ax, scratch_runs))
    if any(recall.get("induction") or recall.get("mqar") for recall in recalls):
        panels.append(lambda ax: induction_panel(ax, scratch_runs, scratch_rows))
    if len({(r["size"], r["attention_share"]) for r in scratch_rows}) > len(
        {r["size"] for r in scratch_rows}
    ):  # some size holds variants of different shares of attention layers
        panels.append(lambda ax: ratio_panel(ax, scratch_rows))
    if curves:
        panels.append(lambda ax: capacity_panel(ax, curves))
    # three to a line, the axes left over removed
    ncols = min(len(panels), 3)
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.6 * ncols + 0.5, 4.2 * nrows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.remove()
    for draw, ax in zip(panels, axes.flat, strict=False):
        draw(ax)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_open(path) as f:  # never a half-written figure
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)


def loss_panel(ax: Any, runs: list[dict]) -> None:
    """Mean val loss over seeds by iteration, one line per size x variant."""
    curves = defaultdict(lambda: defaultdict(list))
    for run in runs:
        for e in run["evals"]:
            curves[(run["size"], run["variant"])][e["iter"]].append(e["val_loss"])
    shown = []
    for (size, name), by_iter in curves.items():
        # the untrained first evaluation would flatten the rest
        its = sorted(i for i in by_iter if i > 0)
        means = [statistics.fmean(by_iter[i]) for i in its]
        shown += means
        ax.plot(its, means, marker=".", label=f"{size} {name}")
    # apart by orders of magnitude (a task some runs solve): log scale
    if shown and max(shown) > 3 * min(shown):
        ax.set_yscale("log")
    elif shown:  # close together: zoom in, the early evaluations cut off
        ax.set_ylim(min(shown) * 0.98, min(max(shown), min(shown) * 1.6))
    ax.set(xlabel="iteration", ylabel="val loss (mean over seeds)")


def gap_panel(ax: Any, rows: list[dict]) -> None:
    """Each variant's paired gap to MHA (95% interval) against MHA's parameters, one point per
    size."""
    size_params = {r["size"]: r["params"] for r in rows if r["variant"] == "mha"}
    variants = [r["variant"] for r in rows if not r["method"] and r["variant"] != "mha"]
    for name in dict.fromkeys(variants):
        mine = [r for r in rows if r["variant"] == name and r["diff_vs_mha"] is not None]
        ax.errorbar(
            [size_params[r["size"]] for r in mine],
            [r["diff_vs_mha"] for r in mine],
            capsize=4,
            marker="o",
            yerr=[r["diff_vs_mha_ci95"] or 0 for r in mine],
            label=name,
        )
    ax.axhline(0, color="gray", lw=0.8)
    split = rows[0]["split"]
    ax.set(
        xlabel="size: MHA's parameters", ylabel=f"{split} loss minus MHA's (paired, 95% interval)"
    )
    if size_params:
        ax.set_xscale("log")
    else:  # a log axis with nothing on it fails to draw
        ax.text(0.5, 0.5, "no MHA run: no gap to MHA", ha="center", transform=ax.transAxes)


def rate_panel(ax: Any, rows: list[dict]) -> None:
    """Mean final val loss over seeds against the learning rate (AdamW's), one line per size x
    variant, the rate chosen for the report ringed."""
    for r in [r for r in rows if r.get("val_loss_by_lr")]:
        points = sorted(
            (float(rate.split("/")[0]), float(loss), rate == r["lr"])
            for rate, loss in losses_by_rate(r).items()
            if loss != "inf"  # a rate at which a seed diverged
        )
        (line,) = ax.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            marker=".",
            label=f"{r['size']} {r['variant']}",
        )
        chosen = [p for p in points if p[2]]
        ax.scatter(
            [p[0] for p in chosen],
            [p[1] for p in chosen],
            s=90,
            facecolors="none",
            edgecolors=line.get_color(),
        )
    ax.set_xscale("log")
    ax.set(xlabel="learning rate (ringed: chosen)", ylabel="final val loss (mean over seeds)")


def conversion_panel(ax: Any, conv: list[dict]) -> None:
    """Val loss by uptraining fraction per size x target x method, the same shape from scratch
    dashed."""

    def line_of(r: dict) -> tuple[str, str, str]:
        return r["size"], conversion_target(r), r["method"]

    for size, t, method in dict.fromkeys(map(line_of, conv)):
        mine = [r for r in conv if line_of(r) == (size, t, method)]
        mine.sort(key=lambda r: r["uptrain_fraction"])
        ax.errorbar(
            [r["uptrain_fraction"] for r in mine],
            [r[f"{r['split']}_loss"] for r in mine],
            capsize=3,
            marker="o",
            yerr=[r[f"{r['split']}_loss_ci95"] or 0 for r in mine],
            label=f"{size} {t} {method}",
        )
        if mine[0]["scratch_loss"] is not None:
            ax.axhline(mine[0]["scratch_loss"], ls="--", lw=0.8, color="gray")
    split = conv[0]["split"]
    ax.set(xlabel="uptraining fraction", ylabel=f"{split} loss (dashed: from scratch)")


def position_panel(ax: Any, runs: list[dict]) -> None:
    """The loss at each context position on the split the runs' recall read (test where the
    dataset has one), mean over seeds (positions without a target left out)."""
    by_position = defaultdict(lambda: defaultdict(list))  # (size, variant) -> {position: losses}
    for run in runs:
        for pos, loss in enumerate((run["recall"] or {}).get("position") or []):
            if loss is not None:
                by_position[(run["size"], run["variant"])][pos].append(loss)
    for (size, name), losses in by_position.items():
        ax.plot(
            sorted(losses),
            [statistics.fmean(losses[p]) for p in sorted(losses)],
            label=f"{size} {name}",
        )
    splits = {(run["recall"] or {}).get("split", "val") for run in runs if run["recall"]}
    split = splits.pop() if len(splits) == 1 else "held-out"
    ax.set(xlabel="position in the context", ylabel=f"{split} loss (mean over seeds)")


def induction_panel(ax: Any, runs: list[dict], rows: list[dict]) -> None:
    """Induction accuracy by distance (mean over seeds), one line per size x variant; MQAR's pooled
    accuracy (95% Wilson interval) as a star at the right, past the longest distance."""
    # (size, variant) -> {distance: accuracies}
    by_distance = defaultdict(lambda: defaultdict(list))
    for run in runs:
        for result in (run["recall"] or {}).get("induction") or []:
            mine = by_distance[(run["size"], run["variant"])]
            mine[result["distance"]].append(result["accuracy"])
    # a line per size x variant, its color kept for its MQAR star
    colors = {}
    for (size, name), accuracies in by_distance.items():
        distances = sorted(accuracies)
        line = ax.plot(
            distances,
            [statistics.fmean(accuracies[d]) for d in distances],
            marker="o",
            label=f"{size} {name}",
        )
        colors[(size, name)] = line[0].get_color()
    ticks = sorted({d for accuracies in by_distance.values() for d in accuracies})
    labels = [str(d) for d in ticks]
    # MQAR's stars, at twice the longest distance; a row with no induction line gets a label
    mqar = [r for r in rows if r.get("mqar_acc") is not None]
    if mqar:
        at = 2 * ticks[-1] if ticks else 1
        for r in mqar:
            key = (r["size"], r["variant"])
            low = r["mqar_acc"] - r["mqar_acc_low"]
            high = r["mqar_acc_high"] - r["mqar_acc"]
            ax.errorbar(
                [at],
                [r["mqar_acc"]],
                yerr=[[low], [high]],
                marker="*",
                capsize=3,
                ms=10,
                color=colors.get(key),
                label=None if key in colors else f"{r['size']} {r['variant']}",
            )

        ticks.append(at)
        labels.append("MQAR")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, labels)
    ax.set(
        xlabel="induction distance (tokens back)",
        ylabel="top-1 accuracy (seeds: mean; MQAR: pooled)",
        ylim=(-0.02, 1.02),
    )


def ratio_panel(ax: Any, rows: list[dict]) -> None:
    """The ratio sweep: final loss (mean, 95% interval) against the share of attention layers, a
    line per size; on a second axis the share of runs that solved MQAR (95% Clopper-Pearson
    interval), dashed, where the runs measured it."""
    split = rows[0]["split"]
    recall = ax.twinx() if any(r.get("mqar_solved") is not None for r in rows) else None
    for size in dict.fromkeys(r["size"] for r in rows):
        mine = sorted((r for r in rows if r["size"] == size), key=lambda r: r["attention_share"])
        shares = [r["attention_share"] for r in mine]
        (line,) = ax.plot([], [])  # the size's color
        ax.errorbar(
            shares,
            [r[f"{split}_loss"] for r in mine],
            yerr=[r.get(f"{split}_loss_ci95") or 0 for r in mine],
            marker="o",
            capsize=3,
            color=line.get_color(),
            label=f"{size} loss",
        )
        solved = [r for r in mine if r.get("mqar_solved") is not None]
        if recall is not None and solved:
            rate = [r["mqar_solved"] / r["mqar_runs"] for r in solved]
            recall.errorbar(
                [r["attention_share"] for r in solved],
                rate,
                yerr=[
                    [k - r["mqar_solved_low"] for k, r in zip(rate, solved, strict=True)],
                    [r["mqar_solved_high"] - k for k, r in zip(rate, solved, strict=True)],
                ],
                marker="s",
                ls="--",
                capsize=3,
                color=line.get_color(),
                label=f"{size} MQAR solved",
            )
    ax.set(xlabel="share of attention layers", ylabel=f"final {split} loss (mean over seeds)")
    if recall is not None:
        recall.set(ylabel="share of runs that solved MQAR", ylim=(-0.02, 1.02))
        recall.legend(fontsize=7, loc="lower right")


def capacity_figure(curves: dict[str, list[Cell]], path: Path) -> None:
    """The capacity curves alone, as a figure at path (scripts/capacity_table.py)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.1, 4.2))
    capacity_panel(ax, curves)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_open(path) as f:  # never a half-written figure
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)


def capacity_panel(ax: Any, curves: dict[str, list[Cell]]) -> None:
    """MQAR test accuracy against the number of key-value pairs (log scale), a line per variant
    through its seeds' mean at each count's chosen rate, each seed a dot."""
    for variant, cells in curves.items():
        pairs = [c.pairs for c in cells]
        (line,) = ax.plot(
            pairs, [statistics.fmean(c.accuracies) for c in cells], marker="o", label=variant
        )
        for c in cells:
            ax.scatter([c.pairs] * len(c.accuracies), c.accuracies, s=8, color=line.get_color())
    ax.set_xscale("log", base=2)
    counts = sorted({c.pairs for cells in curves.values() for c in cells})
    ax.set_xticks(counts, labels=[str(p) for p in counts])
    ax.set(
        xlabel="key-value pairs an example (log scale)",
        ylabel="MQAR test accuracy (each count's rate)",
        ylim=(-0.02, 1.02),
    )
