"""report.md, the comparison's report as text (smallgpt/report.py builds its rows): per size the
variants' table, the verdict sentences against MHA and of each conversion against its variant from
scratch, and the GQA paper's conversion tables."""

from pathlib import Path

from smallgpt import stats
from smallgpt.configs import CompareConfig, label_rates
from smallgpt.measure import table
from smallgpt.plots import conversion_target, losses_by_rate
from smallgpt.recall import LONG_TASKS

# marks a row, or a rate of --lrs, with a run trained for other iterations than the command plans
OTHER_BUDGET = "†"
MATCHES = {
    "width": "width (<variant>: MHA's n_embd and MLP, so fewer parameters)",
    "params": "params (<variant>-params: the MLP widened to MHA's parameter count, within 1%)",
}


def kv_column(cfg: CompareConfig) -> str:
    """The rows' column of KV-cache bytes at the decode speed's context, in kv_dtype."""
    return f"kv_bytes@{cfg.decode_context}_{cfg.kv_dtype}"


def column_interval(row: dict, key: str, n: str = "seeds") -> stats.Estimate | None:
    """A row's column as an Estimate (its _ci95 column the half-width), None when missing."""
    if row.get(key) is None:
        return None
    return stats.Estimate(row[key], row.get(f"{key}_ci95"), row[n] or 0)


def interval_text(row: dict, key: str, n: str = "seeds", signed: bool = False) -> str:
    """A row's column as its interval's text, '-' when missing."""
    interval = column_interval(row, key, n)
    return "-" if interval is None else interval.text(signed)


def markdown(
    rows: list[dict], cfg: CompareConfig, root: Path, notes: list[str], speed_file: str
) -> str:
    """report.md: notes (a sweep still running, runs left out), per size the variants and verdicts,
    conversions. speed_file: where the sweep stored the decode speeds."""
    parts = [
        f"# Attention variants: {root.name}",
        "",
        *(f"**{note}**\n" for note in notes),
        introduction(cfg, speed_file),
        "",
        "Match: "
        + "; ".join(MATCHES[m] for m in sorted({r["match"] for r in rows}, reverse=True))
        + ".",
    ]
    # per size: its variants from scratch, the verdicts, then its conversions
    for size in dict.fromkeys(r["size"] for r in rows):
        mine = [r for r in rows if r["size"] == size]
        scratch = [r for r in mine if not r["method"]]
        conv = [r for r in mine if r["method"]]
        parts += [
            "",
            f"## {size} (n_layer x n_embd)",
            "",
            *variants_table(scratch, cfg),
            *cache_note(scratch),
            *ratio_table(scratch, cfg),
            *long_recall_tables(scratch),
            "",
            *rates_table(scratch),
            *other_budgets_note(mine),
            *verdicts(scratch, conv, kv_column(cfg)),
        ]
        if conv:
            parts += ["", *conversion_tables(scratch, conv)]
    figure = "val loss by iteration; the gap to MHA; conversions; loss by position; recall"
    parts += ["", f"![{figure}](report.png)"]

    return "\n".join(parts) + "\n"


def introduction(cfg: CompareConfig, speed_file: str) -> str:
    """What the report's loss and speed columns hold, and when a difference is called one."""
    long = f"{cfg.decode_context}x{cfg.decode_batch}"
    return (
        "final test loss (val where the dataset has no test split): mean over seeds ± the "
        "half-width of its 95% Student t interval (n: seeds); vs MHA: the seed-paired difference "
        "(variant minus MHA at the same seed: the same data order, and the same initial weights "
        "where shapes allow) ± its own 95% interval; "
        f"positive is worse. decode tok/s @{long}: one-token steps with {cfg.decode_context} "
        f"positions cached for each of {cfg.decode_batch} rows (the variant's shape, float32, "
        "random weights), median of the repeats (min-max), measured once by the sweep and stored "
        f"in {speed_file}; a variant's speed is called different from MHA's only where the 95% "
        "interval of their ratio over the paired repeats leaves out 1."
    )


def variants_table(scratch: list[dict], cfg: CompareConfig) -> list[str]:
    """A size's variants trained from scratch, with their recall accuracies (and a line on those)
    where measured."""
    long = f"{cfg.decode_context}x{cfg.decode_batch}"
    kv = kv_column(cfg)
    split = scratch[0]["split"] if scratch else "val"  # a size with conversions alone: none
    distances = [r["induction_distance"] for r in scratch if r.get("induction_acc") is not None]
    # each harness task's column: the metric it shows
    metrics = {t: m for t in cfg.lm_eval if (m := shown_metric(scratch, t))}
    shown = [
        {
            "variant": r["variant"],
            "params": r["params"],
            "kv": r[kv],
            "trained": f"{r['iters']} it, {r['tokens'] / 1e6:.2f}M tok{budget_mark(r)}",
            "lr": r.get("lr"),
            "loss": f"{interval_text(r, f'{split}_loss')} (n={r['seeds']})",
            "diff": interval_text(r, "diff_vs_mha", "diff_pairs", signed=True),
            "speed": speed_text(r),
            **recall_cells(r, min(distances, default=None)),
            **benchmark_cells(r, metrics),
        }
        for r in scratch
    ]
    columns = {
        "variant": "variant",
        "params": "params",
        "kv": f"KV bytes @{cfg.decode_context} ({cfg.kv_dtype})",
        "trained": "trained",
        "lr": "lr (chosen on val)",
        "loss": f"final {split} loss",
        "diff": "vs MHA (paired)",
        "speed": f"decode tok/s @{long}",
    }
    at = f">= {cfg.solved_threshold:g}"
    if not any(r.get("lr") for r in scratch):
        del columns["lr"]
    if distances:
        columns["induction_solved"] = f"induction solved ({at}) @{min(distances)}"
        columns["induction_acc"] = f"induction acc @{min(distances)}"
    if any(r.get("mqar_acc") is not None for r in scratch):
        columns["mqar_solved"] = f"MQAR solved ({at})"
        columns["mqar_acc"] = "MQAR acc"
    benchmarks = {task: f"{task} {metric}" for task, metric in metrics.items()}
    columns |= benchmarks
    notes = benchmark_note(list(benchmarks.values()))
    if "induction_acc" not in columns and "mqar_acc" not in columns:
        return [table(shown, columns), *notes]
    return [
        table(shown, columns),
        *notes,
        "",
        f"solved: the runs whose accuracy reached {cfg.solved_threshold:g}, of the seeds' runs, "
        "with the 95% Clopper-Pearson interval of that proportion, then the mean accuracy of the "
        "runs that solved it (a recall task is learned all or nothing by seed: read this before "
        "the mean). induction acc @distance (the longest every seed measured) and MQAR acc: top-1 "
        "accuracy pooled over seeds (correct answers over answers) with its 95% Wilson interval; "
        "then vs MHA: the seed-paired difference of the per-seed accuracies ± its 95% Student t "
        "interval; positive is better.",
    ]


def benchmark_note(columns: list[str]) -> list[str]:
    """What the harness's task columns show (an empty line, then the sentence); none without one."""
    if not columns:
        return []
    return [
        "",
        f"{', '.join(columns)}: lm-evaluation-harness's score of each run (eval.py --lm_eval), its "
        "mean over the seeds ± the 95% Student t interval, then vs MHA: the seed-paired "
        "difference ± its interval; positive is better (a perplexity: lower is).",
    ]


def cache_note(scratch: list[dict]) -> list[str]:
    """What a hybrid's KV column counts (an empty line, then the sentence); none without one."""
    if not any(r.get("recurrent_layers") for r in scratch):
        return []
    return [
        "",
        "KV bytes of a variant with recurrent layers (Gated DeltaNet's, KDA's): its attention "
        "layers' K/V, and each recurrent layer's state (fp32, head_dim x head_dim a head) and "
        "last convolution inputs, the same at any context.",
    ]


def ratio_table(scratch: list[dict], cfg: CompareConfig) -> list[str]:
    """Where a size's variants hold different shares of attention layers (a ratio sweep: LLLL,
    DLDL, DDDL, DDDD...): each by that share, most attention first, with its loss, recall, cache
    and speed (an empty line, then the table); none otherwise."""
    if len({r["attention_share"] for r in scratch}) < 2:
        return []
    split = scratch[0]["split"]
    ordered = sorted(scratch, key=lambda r: -r["attention_share"])
    shown = [
        {
            "layers": r["layers"],
            "share": f"{round(r['attention_share'] * len(r['layers']))}/{len(r['layers'])}",
            "variant": r["variant"],
            "loss": f"{interval_text(r, f'{split}_loss')} (n={r['seeds']})",
            "diff": interval_text(r, "diff_vs_mha", "diff_pairs", signed=True),
            "kv": f"{r[kv_column(cfg)]:,}",
            "speed": speed_text(r),
            **recall_cells(r, None),
        }
        for r in ordered
    ]
    columns = {
        "layers": "layers",
        "share": "attention layers",
        "variant": "variant",
        "loss": f"final {split} loss",
        "diff": "vs MHA (paired)",
    }
    if any(r.get("mqar_solved") is not None for r in scratch):
        columns["mqar_solved"] = f"MQAR solved (>= {cfg.solved_threshold:g})"
        columns["mqar_acc"] = "MQAR acc"
    columns["kv"] = f"KV bytes @{cfg.decode_context} ({cfg.kv_dtype})"
    columns["speed"] = f"decode tok/s @{cfg.decode_context}x{cfg.decode_batch}"
    return [
        "",
        "By the share of attention layers (the ratio sweep; report.png plots loss and recall "
        "against it):",
        "",
        table(shown, columns),
    ]


def long_recall_tables(scratch: list[dict]) -> list[str]:
    """Per task of recall.LONG_TASKS that a size's variants measured (report.long_recall_columns),
    a table of the examples each solved at each cell (a length; the needle's, a length and a
    depth), pooled over its seeds, with the 95% Clopper-Pearson interval (an empty line, a line on
    what the cells hold, an empty line, then the table); none where no variant measured it."""
    out = []
    for task in LONG_TASKS:
        prefix = f"{task}_solved@"
        rows = [r for r in scratch if any(k.startswith(prefix) for k in r)]
        if not rows:
            continue
        cells = list(
            dict.fromkeys(k.removeprefix(prefix) for r in rows for k in r if k.startswith(prefix))
        )
        shown = [
            {
                "layers": r["layers"],
                "variant": r["variant"],
                **{cell: solved_text(r, task, cell) for cell in cells},
            }
            for r in rows
        ]
        columns = {"layers": "layers", "variant": "variant"}
        columns |= {cell: cell_heading(cell) for cell in cells}
        out += [
            "",
            f"{task} past the trained length (--final_evals' {task} at each run's end), by "
            "length in tokens: the examples solved (every answer the model's top token) pooled "
            "over the seeds, of all, with the 95% Clopper-Pearson interval of that share. The "
            "interval counts examples as independent, and seeds may differ by more: each seed's "
            f"count is report.csv's {task}_by_seed@<cell>.",
            "",
            table(shown, columns),
        ]
    return out


def solved_text(row: dict, task: str, cell: str) -> str:
    """A row's pooled long-recall cell: '525/768 (0.650-0.716)', or '-' where not measured."""
    k = row.get(f"{task}_solved@{cell}")
    if k is None:
        return "-"
    n = row[f"{task}_n@{cell}"]
    return stats.Solved(k, n, *stats.exact_interval(k, n), None).text()


def cell_heading(cell: str) -> str:
    """A long-recall cell's column heading: '504' or '504, depth 0.25'."""
    length, _, depth = cell.partition("@")
    return f"{length}, depth {depth}" if depth else length


def rates_table(scratch: list[dict]) -> list[str]:
    """A size's variants' mean final val loss at each learning rate of --lrs, the chosen one
    starred, and what the choice is (then an empty line); none without --lrs."""
    rows = [r for r in scratch if r.get("val_loss_by_lr")]
    if not rows:
        return []
    cells = []
    for r in rows:
        by_rate = losses_by_rate(r)
        shown_loss = {rate: "diverged" if loss == "inf" else loss for rate, loss in by_rate.items()}
        off_budget = other_budget_rates(r)
        marked = {
            rate: loss
            + (" *" if rate == r["lr"] else "")
            + (f" {OTHER_BUDGET}" if rate in off_budget else "")
            for rate, loss in shown_loss.items()
        }
        cells.append({"variant": r["variant"], **marked})
    rates = sorted(
        {rate for cell in cells for rate in cell if rate != "variant"}, key=rate_order
    )  # --bracket's rates past the grid among the others, lowest first
    shown = [{"variant": c["variant"], **{rate: c.get(rate, "-") for rate in rates}} for c in cells]
    at_edge = [r["variant"] for r in rows if chosen_at_edge(r)]
    return [
        "Final val loss by learning rate (mean over seeds; * the rate chosen): each variant is "
        "reported at the rate of --lrs with the lowest, chosen on the val split; the table above "
        f"gives its figures on the {scratch[0]['split']} split"
        + (", which the choice never saw." if scratch[0]["split"] == "test" else "."),
        "",
        table(shown),
        "",
        *(
            [
                f"At an edge of the rates it trained at (a rate further out may be better: "
                f"--bracket): {', '.join(at_edge)}.",
                "",
            ]
            if at_edge
            else []
        ),
    ]


def rate_order(label: str) -> tuple[float, float]:
    """A rate's label ('0.003', '0.003/0.02') as numbers to sort by."""
    lr, muon = label_rates(label)
    return lr, muon or 0.0


def chosen_at_edge(row: dict) -> bool:
    """Whether a row's chosen rate is the lowest or highest of two or more it trained at (by
    AdamW's rate)."""
    tried = {label_rates(rate)[0] for rate in losses_by_rate(row)}
    chosen = label_rates(row["lr"])[0]
    return len(tried) > 1 and chosen in (min(tried), max(tried))


def other_budget_rates(row: dict) -> dict[str, str]:
    """A row's rates of --lrs with runs trained for other iterations than planned: {rate: those
    runs with their iterations} (its lr_other_iters column)."""
    listed = row.get("lr_other_iters")
    if not listed:
        return {}
    return dict(item.split("=", 1) for item in listed.split("; "))


def budget_mark(row: dict) -> str:
    """' †' for a cell of a row with a run trained for other iterations than the rest, or ''."""
    if row["other_iters"]:
        return f" {OTHER_BUDGET}"
    return ""


def other_budgets_note(rows: list[dict]) -> list[str]:
    """A line (then an empty one) naming the runs of rows, and of the rates their choice was made
    from, trained for other iterations than the command plans for them; none if there is none."""
    odd = [r["other_iters"] for r in rows if r["other_iters"]]
    for r in rows:
        odd += [runs for runs in other_budget_rates(r).values() if runs not in odd]
    if not odd:
        return []
    return [
        f"{OTHER_BUDGET} Trained for other iterations than this command's budget (max_iters, "
        f"or a conversion's fraction of it), so not comparable with the rest: {'; '.join(odd)} "
        f"iterations. Train every run to one budget (compare.py --extend=True trains runs on "
        f"to the sweep's max_iters).",
        "",
    ]


def recall_cells(row: dict, distance: int | None) -> dict[str, str]:
    """A row's recall cells: the runs that solved each task ('3/5 (0.147-0.947), acc 0.981') and
    the accuracies ('0.912 (0.897-0.925) @64, +0.0100 ± 0.0200 vs MHA': @64 only off distance), or
    '-'."""
    cells = dict.fromkeys(("induction_solved", "induction_acc", "mqar_solved", "mqar_acc"), "-")
    for task in ("induction", "mqar"):
        if row.get(f"{task}_solved") is not None:
            won = stats.Solved(
                *(row[f"{task}_{k}"] for k in ("solved", "runs", "solved_low", "solved_high")),
                row[f"{task}_acc_of_solved"],
            )
            cells[f"{task}_solved"] = won.text()
    for key in [key for key in ("induction_acc", "mqar_acc") if row.get(key) is not None]:
        cells[key] = f"{row[key]:.3f} ({row[f'{key}_low']:.3f}-{row[f'{key}_high']:.3f})"
        if key == "induction_acc" and row["induction_distance"] != distance:
            cells[key] += f" @{row['induction_distance']}"
        if row[f"{key}_diff_vs_mha"] is not None:
            cells[key] += f", {interval_text(row, f'{key}_diff_vs_mha', signed=True)} vs MHA"
    return cells


def shown_metric(rows: list[dict], task: str) -> str | None:
    """The metric a task's column shows: acc_norm where the rows have it (the length-normalised
    accuracy quoted for HellaSwag and ARC), else acc, else the first the rows have; None if none."""
    prefix = f"{task}_"
    metrics = [
        k.removeprefix(prefix)
        for r in rows
        for k in r
        if k.startswith(prefix) and not k.endswith(("_ci95", "_diff_vs_mha", "_diff_pairs"))
    ]
    for metric in ("acc_norm", "acc", *metrics):
        if metric in metrics:
            return metric
    return None


def benchmark_cells(row: dict, metrics: dict[str, str]) -> dict[str, str]:
    """A row's cell of each harness task of metrics ({task: the metric its column shows}):
    '0.9300 ± 0.0100, +0.0100 ± 0.0200 vs MHA', or '-'."""
    cells = {}
    for task, metric in metrics.items():
        key = f"{task}_{metric}"
        cells[task] = interval_text(row, key)
        if row.get(f"{key}_diff_vs_mha") is not None:
            diff = interval_text(row, f"{key}_diff_vs_mha", f"{key}_diff_pairs", signed=True)
            cells[task] += f", {diff} vs MHA"
    return cells


def speed_text(row: dict) -> str:
    """A row's decode speed: '1,234 (1,200-1,300)', the median of the repeats (min-max), or '-'."""
    if row["decode_tok_s"] is None:
        return "-"
    low = f"{row['decode_tok_s_min']:,.0f}"
    high = f"{row['decode_tok_s_max']:,.0f}"
    return f"{row['decode_tok_s']:,.0f} ({low}-{high})"


def verdicts(scratch: list[dict], conv: list[dict], kv: str) -> list[str]:
    """A sentence per variant against MHA, and per conversion (longest uptraining) against its shape
    from scratch."""
    mha = next((r for r in scratch if r["variant"] == "mha"), None)
    lines = []
    if mha is None and scratch:
        lines.append(
            "- No MHA run at this size (n_kv_head = n_head missing from --kv_heads): no difference "
            "to MHA to show; add n_head to --kv_heads (or mha to --variants) to compare against it."
        )
    if mha is not None:
        lines += [f"- {variant_verdict(r, mha, kv)}" for r in scratch if r is not mha]
    lines += conversion_verdicts(scratch, conv)
    return lines


def variant_verdict(row: dict, mha: dict, kv: str) -> str:
    """A variant's val loss against MHA's, then its decode speed against MHA's where measured."""
    what = (
        f"{row['variant']} ({row['params'] / mha['params']:.0%} of MHA's parameters, "
        f"{mha[kv] / row[kv]:g}x smaller KV cache)"
    )
    line = stats.verdict(what, "MHA", column_interval(row, "diff_vs_mha", "diff_pairs"))
    if row["decode_vs_mha"] is None:
        return line
    columns = ("decode_vs_mha", "decode_vs_mha_low", "decode_vs_mha_high", "decode_vs_mha_pairs")
    ratio = stats.SpeedRatio(*(row[k] for k in columns))
    return line + " " + stats.speed_verdict(ratio, "MHA")


def conversion_verdicts(scratch: list[dict], conv: list[dict]) -> list[str]:
    """A sentence per conversion uptrained the longest, against its variant from scratch."""
    longest = max((r["uptrain_fraction"] for r in conv), default=None)
    trained = {r["variant"] for r in scratch}
    lines = []
    for r in [r for r in conv if r["uptrain_fraction"] == longest]:
        target = conversion_target(r)
        what = f"{target} converted by {r['method']} and uptrained {longest:g}"
        if longest and r.get("uptrained_by"):
            what += f" by {r['uptrained_by']}"
        if target not in trained:
            lines.append(
                f"- {what}: no {target} trained from scratch at its shape (--match=width) to "
                f"compare with."
            )
            continue
        diff = column_interval(r, "diff_vs_scratch", "diff_vs_scratch_pairs")
        lines.append(f"- {stats.verdict(what, f'{target} from scratch', diff)}")
    return lines


def conversion_tables(scratch: list[dict], conv: list[dict]) -> list[str]:
    """The GQA paper's ablations: val loss by conversion method (longest uptraining) and by
    uptraining fraction."""
    fractions = sorted({r["uptrain_fraction"] for r in conv})
    methods = list(dict.fromkeys(r["method"] for r in conv))
    targets = list(dict.fromkeys(conversion_target(r) for r in conv))
    # each conversion's val loss by (target, method, fraction), and each target's from scratch
    cell = {}
    for r in conv:
        key = (conversion_target(r), r["method"], r["uptrain_fraction"])
        cell[key] = interval_text(r, f"{r['split']}_loss") + budget_mark(r)
    own = {r["variant"]: interval_text(r, f"{r['split']}_loss") for r in scratch}
    by_method = [
        {
            "target": t,
            "scratch": own.get(t, "-"),
            **{m: cell.get((t, m, fractions[-1]), "-") for m in methods},
        }
        for t in targets
    ]
    by_fraction = [
        {
            "target": t,
            "method": m,
            **{f"{f:g}": cell.get((t, m, f), "-") for f in fractions},
            "scratch": own.get(t, "-"),
        }
        for t in targets
        for m in methods
        if any((t, m, f) in cell for f in fractions)
    ]
    # what the uptraining trained on (the runs uptrained 0 iterations trained on nothing)
    ways = sorted(
        {r["uptrained_by"] for r in conv if r["uptrain_fraction"] and r.get("uptrained_by")}
    )
    by = f" by {' and '.join(ways)}" if ways else ""
    lines = [
        f"Conversion from MHA by method, uptrained for {fractions[-1]:g} of the base run's "
        f"iterations{by} (GQA paper, fig. 5):",
        "",
        table(by_method),
        "",
        "Conversion from MHA by uptraining fraction, 0 = evaluated right after conversion (GQA "
        "paper, fig. 6):",
        "",
        table(by_fraction),
    ]
    if any(r.get("mqar_solved") is not None for r in conv):
        lines += ["", *recall_by_fraction(scratch, conv, fractions)]
    return lines


def recall_by_fraction(scratch: list[dict], conv: list[dict], fractions: list[float]) -> list[str]:
    """What conversion does to recall: each conversion's MQAR solved and accuracy cells
    (recall_cells) by uptraining fraction, beside its target's from scratch."""
    solved = {}
    for r in conv:
        cells = recall_cells(r, None)
        solved[(conversion_target(r), r["method"], r["uptrain_fraction"])] = (
            f"{cells['mqar_solved']}; {cells['mqar_acc']}"
        )
    own = {}
    for r in scratch:
        cells = recall_cells(r, None)
        own[r["variant"]] = f"{cells['mqar_solved']}; {cells['mqar_acc']}"
    rows = [
        {
            "target": t,
            "method": m,
            **{f"{f:g}": solved.get((t, m, f), "-") for f in fractions},
            "scratch": own.get(t, "-"),
        }
        for t, m in dict.fromkeys((t, m) for t, m, _ in solved)
    ]
    return [
        "MQAR after conversion by uptraining fraction: the runs that solved it, then the pooled "
        "accuracy:",
        "",
        table(rows),
    ]
