"""The attention-variant comparison's report (compare.py), from the runs' log.jsonl files and the stored speed
measurements alone: each variant x size x conversion over its seeds (mean val loss with its 95% interval, the
seed-paired difference to MHA, recall accuracies pooled with Wilson intervals), the GQA paper's conversion tables,
a verdict per size, and report.md, report.csv, report.png (smallgpt/plots.py) and (with wandb_log) a wandb Table."""

import csv
import dataclasses
import json
import statistics
import sys
from collections import Counter, defaultdict
from pathlib import Path

import torch

from model import GPT, GPTConfig
from smallgpt import stats, sweep
from smallgpt.atomic import atomic_open
from smallgpt.checkpoint import parse_source
from smallgpt.configs import CompareConfig, TrainConfig
from smallgpt.convert import CONVERT_METHODS
from smallgpt.errors import UserError
from smallgpt.measure import table
from smallgpt.plots import conversion_target, plot
from smallgpt.runlog import read_run, start_wandb, unfinished

SPEED_FILE = "speed.json"
OTHER_BUDGET = "†"  # marks a row with a run trained for other iterations than its comparison's
MATCHES = {
    "width": "width (<variant>: MHA's n_embd and MLP, so fewer parameters)",
    "params": "params (<variant>-params: the MLP widened to MHA's parameter count, within 1%)",
}


def speed_key(c: GPTConfig, context: int, batch: int) -> str:
    """A shape's key in speed.json: what the cached-step decode speed depends on."""
    kv = (
        f"kv{c.n_kv_head}"
        if c.kv_lora_rank is None
        else f"mla{c.kv_lora_rank}r{c.qk_rope_head_dim}"
    )
    shape = f"{c.n_layer}x{c.n_embd}-h{c.n_head}-{kv}-mlp{c.mlp_hidden}-{c.pos_encoding}"
    return f"{shape}{sweep.window_suffix(c)}@{context}x{batch}"  # all global: the keys stored before windows


def read_runs(root: Path) -> tuple[list[dict], str | None]:
    """Every finished run under root (runlog.unfinished: its final evaluation logged whole), read_run's record plus
    what the sweep's tags say of it; and a sentence naming those left out as unfinished (None if none), also
    printed on stderr: a run's final val loss is never an earlier evaluation's."""
    dirs = sorted(p.parent for p in root.glob("*/log.jsonl"))
    if not dirs:
        raise UserError(
            f"no runs under {root} (no */log.jsonl): run the sweep first (--mode=train)"
        )
    runs = [read_run(d) | {"dir": str(d)} for d in dirs]
    left_out = None
    if why := {
        r["dir"]: reason for r in runs if (reason := unfinished(r))
    }:  # e.g. stopped, killed, still running
        left_out = (
            f"Left out of the report, unfinished: {'; '.join(f'{d} ({w})' for d, w in why.items())}. Run "
            f"the sweep again (--mode=train) to finish them."
        )
        print(left_out, file=sys.stderr)
        runs = [r for r in runs if r["dir"] not in why]
    if not runs:
        raise UserError(
            f"no run under {root} has finished yet ({len(why)} unfinished): run the sweep (--mode=train)"
        )
    for r in runs:
        cfg, mc, tags = r["config"], r["model_config"], r["config"].get("wandb_tags") or []
        kv = dict(t.split("=", 1) for t in tags if "=" in t)
        converted = parse_source(cfg["init_from"]).kind == "convert"
        r |= {
            "variant": tags[0] if tags and "=" not in tags[0] else r["name"],
            "seed": cfg["seed"],
            "size": kv.get("size", f"{mc['n_layer']}x{mc['n_embd']}"),
            "match": kv.get("match", "width"),
            "method": kv.get("convert", cfg.get("convert_method", "mean")) if converted else None,
            "fraction": float(kv["uptrain"]) if "uptrain" in kv else None,
            "model": GPTConfig(**mc),
            "final": r["evals"][-1]["val_loss"],
            "iters": r["evals"][-1]["iter"],
            "tokens": r["evals"][-1]["iter"]
            * cfg["gradient_accumulation_steps"]
            * cfg["batch_size"]
            * cfg["block_size"],
        }
    return runs, left_out


def summary_rows(
    runs: list[dict], speeds: dict[str, list[float]], cfg: CompareConfig
) -> list[dict]:
    """One row per size x variant (conversions: x method x fraction), over its seeds (cfg: KV and speed settings)."""
    by_seed = defaultdict(dict)  # (size, variant) -> {seed: run}
    for r in runs:
        if (
            old := by_seed[(r["size"], r["variant"])].get(r["seed"])
        ) is not None:  # e.g. an earlier sweep's folder
            print(
                f"two runs of {r['variant']} at seed {r['seed']}: {old['dir']} left out, {r['dir']} kept",
                file=sys.stderr,
            )
        by_seed[(r["size"], r["variant"])][r["seed"]] = r
    groups = {k: list(g.values()) for k, g in by_seed.items()}
    odd = other_budgets(groups)
    finals = {k: {seed: r["final"] for seed, r in g.items()} for k, g in by_seed.items()}
    speed_of = {
        k: speeds.get(speed_key(g[0]["model"], cfg.decode_context, cfg.decode_batch), [])
        for k, g in groups.items()
    }
    kv_dtype = getattr(torch, cfg.kv_dtype)
    out = []
    for (size, name), group in groups.items():
        first, m = group[0], group[0]["model"]
        with torch.device("meta"):
            model = GPT(m)
        est = stats.mean_interval([r["final"] for r in group])
        diff = (
            stats.paired_difference(finals[(size, name)], finals[(size, "mha")])
            if (size, "mha") in finals and name != "mha"
            else None
        )
        speed = speed_of[(size, name)]
        speed_vs = (
            stats.speed_ratio(speed, speed_of.get((size, "mha"), [])) if name != "mha" else None
        )
        trains = [
            statistics.median(t["tokens_per_s"] for t in r["trains"]) for r in group if r["trains"]
        ]
        row = {
            "size": size,
            "variant": name,
            "n_head": m.n_head,
            "n_kv_head": m.n_kv_head,
            "kv_lora_rank": m.kv_lora_rank,
            "match": first["match"],
            "method": first["method"],
            "uptrain_fraction": first["fraction"],
            "params": model.num_params(),
            "mlp_hidden": m.mlp_hidden,
            "attention_params": model.attention_params_per_layer() * m.n_layer,
            f"kv_bytes@{cfg.decode_context}_{cfg.kv_dtype}": m.kv_cache_bytes(
                1, cfg.decode_context, kv_dtype
            ),
            f"kv_bytes@{cfg.kv_seq_len}x{cfg.kv_batch}": m.kv_cache_bytes(
                cfg.kv_batch, cfg.kv_seq_len, kv_dtype
            ),
            "iters": first["iters"],
            "iters_by_seed": " ".join(str(r["iters"]) for r in group),
            "other_iters": other_iters(group, odd),
            "tokens": first["tokens"],
            "seeds": est.n,
            "val_loss": est.mean,
            "val_loss_ci95": est.half_width,
            "val_loss_by_seed": " ".join(f"{r['final']:.4f}" for r in group),
            "diff_vs_mha": diff and diff.mean,
            "diff_vs_mha_ci95": diff and diff.half_width,
            "diff_pairs": diff and diff.n,
        }
        if first["method"]:
            scratch = finals.get((size, conversion_target({"variant": name})))
            after = stats.mean_interval([r["evals"][0]["val_loss"] for r in group])
            vs = stats.paired_difference(finals[(size, name)], scratch) if scratch else None
            row |= {
                "val_loss_after_conversion": after.mean,
                "scratch_val_loss": scratch and statistics.fmean(scratch.values()),
                "diff_vs_scratch": vs and vs.mean,
                "diff_vs_scratch_ci95": vs and vs.half_width,
                "diff_vs_scratch_pairs": vs and vs.n,
            }
        row |= {
            "decode_tok_s": statistics.median(speed) if speed else None,
            "decode_tok_s_min": min(speed, default=None),
            "decode_tok_s_max": max(speed, default=None),
            "decode_repeats": len(speed),
            "decode_vs_mha": speed_vs and speed_vs.ratio,
            "decode_vs_mha_low": speed_vs and speed_vs.low,
            "decode_vs_mha_high": speed_vs and speed_vs.high,
            "decode_vs_mha_pairs": speed_vs and speed_vs.n,
            "train_tok_s": statistics.median(trains) if trains else None,
            "wall_s": statistics.fmean(
                max(e["wall_s"] for e in r["evals"] + r["trains"]) for r in group
            ),
        }
        out.append(
            row | recall_columns(group, groups.get((size, "mha")) if name != "mha" else None)
        )
    smallest = {
        size: min(r["params"] for r in out if r["size"] == size)
        for size in {r["size"] for r in out}
    }
    methods = {m: i for i, m in enumerate(CONVERT_METHODS)}
    return sorted(
        out,
        key=lambda r: (
            smallest[r["size"]],
            r["size"],
            r["method"] is not None,  # MHA first, by KV:
            -r[f"kv_bytes@{cfg.decode_context}_{cfg.kv_dtype}"],
            r["match"] == "params",
            methods.get(r["method"], -1),
            r["uptrain_fraction"] or 0,
        ),
    )


def other_budgets(groups: dict[tuple, list[dict]]) -> set[str]:
    """The folders of the runs trained for other iterations than the rest of their comparison (a
    size's runs from scratch, or its conversions uptrained for one fraction): those off the most
    common count, or all of a comparison where no count is the most common."""
    comparisons = defaultdict(list)
    for (size, _), group in groups.items():
        for r in group:
            comparisons[(size, r["fraction"])].append(r)
    odd = set()
    for members in comparisons.values():
        counts = Counter(r["iters"] for r in members).most_common()  # [(iters, runs), ...]
        if len(counts) == 1:
            continue
        tied = counts[0][1] == counts[1][1]
        odd |= {r["dir"] for r in members if tied or r["iters"] != counts[0][0]}
    return odd


def other_iters(group: list[dict], odd: set[str]) -> str | None:
    """'gqa2-s1338 60': the runs of a row among odd (other_budgets), with their iterations."""
    named = [f"{Path(r['dir']).name} {r['iters']}" for r in group if r["dir"] in odd]
    return "; ".join(named) or None


def recall_columns(group: list[dict], mha: list[dict] | None) -> dict:
    """A group's recall columns where every run measured the task: induction at the longest common distance, MQAR."""
    recalls = {r["seed"]: r["recall"] or {} for r in group}
    theirs = {r["seed"]: r["recall"] or {} for r in mha or []}
    induction = {
        seed: {i["distance"]: i for i in rec.get("induction", [])} for seed, rec in recalls.items()
    }
    out = {}
    if common := set.intersection(*(set(by_distance) for by_distance in induction.values())):
        distance = max(common)
        at = {seed: by_distance[distance] for seed, by_distance in induction.items()}
        mha_at = {
            seed: i
            for seed, r in theirs.items()
            for i in r.get("induction", [])
            if i["distance"] == distance
        }
        out |= {
            "induction_distance": distance,
            "induction_loss": statistics.fmean(i["loss"] for i in at.values()),
            **accuracy_columns("induction_acc", at, mha_at),
        }
    if all("mqar" in rec for rec in recalls.values()):
        out |= accuracy_columns(
            "mqar_acc",
            {seed: rec["mqar"] for seed, rec in recalls.items()},
            {seed: rec["mqar"] for seed, rec in theirs.items() if "mqar" in rec},
        )
    return out


def accuracy_columns(name: str, results: dict[int, dict], mha: dict[int, dict]) -> dict:
    """name's columns from stats.pooled_accuracy of the seeds' results against MHA's."""
    acc = stats.pooled_accuracy(results, mha)
    return {
        name: acc.accuracy,
        f"{name}_low": acc.low,
        f"{name}_high": acc.high,
        f"{name}_diff_vs_mha": acc.diff and acc.diff.mean,
        f"{name}_diff_vs_mha_ci95": acc.diff and acc.diff.half_width,
    }


def column_interval(row: dict, key: str, n: str = "seeds") -> stats.Estimate | None:
    """A row's column as an Estimate (its _ci95 column the half-width), None when missing."""
    return (
        None
        if row.get(key) is None
        else stats.Estimate(row[key], row.get(f"{key}_ci95"), row[n] or 0)
    )


def interval_text(row: dict, key: str, n: str = "seeds", signed: bool = False) -> str:
    """A row's column as its interval's text, '-' when missing."""
    interval = column_interval(row, key, n)
    return "-" if interval is None else interval.text(signed)


def markdown(rows: list[dict], cfg: CompareConfig, root: Path, notes: list[str]) -> str:
    """report.md: notes (a sweep still running, runs left out), per size the variants and verdicts, conversions."""
    long, kv = (
        f"{cfg.decode_context}x{cfg.decode_batch}",
        f"kv_bytes@{cfg.decode_context}_{cfg.kv_dtype}",
    )
    parts = [
        f"# Attention variants: {root.name}",
        "",
        *(f"**{note}**\n" for note in notes),
        "final val loss: mean over seeds ± the half-width of its 95% Student t interval (n: seeds); vs MHA: "
        "the seed-paired difference (variant minus MHA at the same seed: the same data order, and the same "
        "initial weights where shapes allow) ± its own 95% interval; positive is worse. "
        f"decode tok/s @{long}: one-token steps with {cfg.decode_context} positions cached for each of "
        f"{cfg.decode_batch} rows (the variant's shape, float32, random weights), median of the repeats "
        f"(min-max), measured once by the sweep and stored in {SPEED_FILE}; a variant's speed is called different "
        f"from MHA's only where the 95% interval of their ratio over the paired repeats leaves out 1.",
        "",
        "Match: "
        + "; ".join(MATCHES[m] for m in sorted({r["match"] for r in rows}, reverse=True))
        + ".",
    ]
    for size in dict.fromkeys(r["size"] for r in rows):
        mine = [r for r in rows if r["size"] == size]
        scratch, conv = [r for r in mine if not r["method"]], [r for r in mine if r["method"]]
        parts += [
            "",
            f"## {size} (n_layer x n_embd)",
            "",
            *variants_table(scratch, cfg),
            "",
            *other_budgets_note(mine),
            *verdicts(scratch, conv, kv),
        ]
        if conv:
            parts += ["", *conversion_tables(scratch, conv)]
    parts += [
        "",
        "![val loss by iteration; the gap to MHA; conversions; loss by position; recall](report.png)",
    ]
    return "\n".join(parts) + "\n"


def variants_table(scratch: list[dict], cfg: CompareConfig) -> list[str]:
    """A size's variants trained from scratch, with their recall accuracies (and a line on those) where measured."""
    long, kv = (
        f"{cfg.decode_context}x{cfg.decode_batch}",
        f"kv_bytes@{cfg.decode_context}_{cfg.kv_dtype}",
    )
    distances = [r["induction_distance"] for r in scratch if r.get("induction_acc") is not None]
    shown = [
        {
            "variant": r["variant"],
            "params": r["params"],
            "kv": r[kv],
            "trained": f"{r['iters']} it, {r['tokens'] / 1e6:.2f}M tok{budget_mark(r)}",
            "loss": f"{interval_text(r, 'val_loss')} (n={r['seeds']})",
            "diff": interval_text(r, "diff_vs_mha", "diff_pairs", signed=True),
            "speed": speed_text(r),
            **recall_cells(r, min(distances, default=None)),
        }
        for r in scratch
    ]
    columns = {
        "variant": "variant",
        "params": "params",
        "kv": f"KV bytes @{cfg.decode_context} ({cfg.kv_dtype})",
        "trained": "trained",
        "loss": "final val loss",
        "diff": "vs MHA (paired)",
        "speed": f"decode tok/s @{long}",
    }
    if distances:
        columns["induction_acc"] = f"induction acc @{min(distances)}"
    if any(r.get("mqar_acc") is not None for r in scratch):
        columns["mqar_acc"] = "MQAR acc"
    if "induction_acc" not in columns and "mqar_acc" not in columns:
        return [table(shown, columns)]
    return [
        table(shown, columns),
        "",
        "induction acc @distance (the longest every seed measured) and MQAR acc: top-1 "
        "accuracy pooled over seeds (correct answers over answers) with its 95% Wilson interval; then vs MHA: the "
        "seed-paired difference of the per-seed accuracies ± its 95% Student t interval; positive is better.",
    ]


def budget_mark(row: dict) -> str:
    """' †' for a cell of a row with a run trained for other iterations than the rest, or ''."""
    if row["other_iters"]:
        return f" {OTHER_BUDGET}"
    return ""


def other_budgets_note(rows: list[dict]) -> list[str]:
    """A line (then an empty one) naming the runs of rows trained for other iterations than the
    rest of their comparison; none if there is none."""
    odd = [r["other_iters"] for r in rows if r["other_iters"]]
    if not odd:
        return []
    return [
        f"{OTHER_BUDGET} Trained for other iterations than the rest of their comparison, so "
        f"not comparable with them: {'; '.join(odd)} iterations. Train every run to one "
        f"budget (compare.py --extend=True trains runs on to the sweep's max_iters).",
        "",
    ]


def recall_cells(row: dict, distance: int | None) -> dict[str, str]:
    """A row's accuracies: '0.912 (0.897-0.925) @64, +0.0100 ± 0.0200 vs MHA' (@64 only off distance), or '-'."""
    cells = dict.fromkeys(("induction_acc", "mqar_acc"), "-")
    for key in [key for key in cells if row.get(key) is not None]:
        cells[key] = f"{row[key]:.3f} ({row[f'{key}_low']:.3f}-{row[f'{key}_high']:.3f})"
        if key == "induction_acc" and row["induction_distance"] != distance:
            cells[key] += f" @{row['induction_distance']}"
        if row[f"{key}_diff_vs_mha"] is not None:
            cells[key] += f", {interval_text(row, f'{key}_diff_vs_mha', signed=True)} vs MHA"
    return cells


def speed_text(row: dict) -> str:
    if row["decode_tok_s"] is None:
        return "-"
    return f"{row['decode_tok_s']:,.0f} ({row['decode_tok_s_min']:,.0f}-{row['decode_tok_s_max']:,.0f})"


def verdicts(scratch: list[dict], conv: list[dict], kv: str) -> list[str]:
    """A sentence per variant against MHA, and per conversion (longest uptraining) against its shape from scratch."""
    mha, lines = next((r for r in scratch if r["variant"] == "mha"), None), []
    if mha is None and scratch:
        lines.append(
            "- No MHA run at this size (n_kv_head = n_head missing from --kv_heads): no difference to MHA "
            "to show; add n_head to --kv_heads (or mha to --variants) to compare against it."
        )
    for r in scratch if mha else []:
        if r is not mha:
            what = (
                f"{r['variant']} ({r['params'] / mha['params']:.0%} of MHA's parameters, {mha[kv] / r[kv]:g}x "
                f"smaller KV cache)"
            )
            line = stats.verdict(what, "MHA", column_interval(r, "diff_vs_mha", "diff_pairs"))
            if r["decode_vs_mha"] is not None:
                columns = (
                    "decode_vs_mha",
                    "decode_vs_mha_low",
                    "decode_vs_mha_high",
                    "decode_vs_mha_pairs",
                )
                line += " " + stats.speed_verdict(stats.SpeedRatio(*(r[k] for k in columns)), "MHA")
            lines.append(f"- {line}")
    longest = max((r["uptrain_fraction"] for r in conv), default=None)
    trained = {r["variant"] for r in scratch}
    for r, target in ((r, conversion_target(r)) for r in conv if r["uptrain_fraction"] == longest):
        what = f"{target} converted by {r['method']} and uptrained {longest:g}"
        diff = column_interval(r, "diff_vs_scratch", "diff_vs_scratch_pairs")
        lines.append(
            f"- {stats.verdict(what, f'{target} from scratch', diff)}"
            if target in trained
            else f"- {what}: no {target} trained from scratch at its shape (--match=width) to compare with."
        )
    return lines


def conversion_tables(scratch: list[dict], conv: list[dict]) -> list[str]:
    """The GQA paper's ablations: val loss by conversion method (longest uptraining) and by uptraining fraction."""
    fractions = sorted({r["uptrain_fraction"] for r in conv})
    methods = list(dict.fromkeys(r["method"] for r in conv))
    targets = list(dict.fromkeys(conversion_target(r) for r in conv))
    cell = {}
    for r in conv:
        key = (conversion_target(r), r["method"], r["uptrain_fraction"])
        cell[key] = interval_text(r, "val_loss") + budget_mark(r)
    own = {r["variant"]: interval_text(r, "val_loss") for r in scratch}
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
    return [
        f"Conversion from MHA by method, uptrained for {fractions[-1]:g} of the base run's iterations (GQA "
        f"paper, fig. 5):",
        "",
        table(by_method),
        "",
        "Conversion from MHA by uptraining fraction, 0 = evaluated right after conversion (GQA paper, fig. 6):",
        "",
        table(by_fraction),
    ]


def write_report(
    root: Path, cfg: CompareConfig, base: TrainConfig, status: str | None = None
) -> str:
    """report.md, report.csv and report.png under root from its runs' logs (and, with base.wandb_log, the rows as
    a wandb Table in one more run of the sweep's group); returns report.md's text, which starts with status (the
    sweep still running) and the runs left out, if any."""
    runs, left_out = read_runs(root)
    speeds = json.loads((root / SPEED_FILE).read_text()) if (root / SPEED_FILE).is_file() else {}
    rows = summary_rows(runs, speeds, cfg)
    text = markdown(rows, cfg, root, [note for note in (status, left_out) if note])
    with atomic_open(root / "report.md", "w") as f:
        f.write(text)
    with atomic_open(root / "report.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        writer.writerows(rows)
    plot(runs, rows, root / "report.png")
    if base.wandb_log:
        log_table(rows, base, root)
    return text


def log_table(rows: list[dict], base: TrainConfig, root: Path) -> None:
    """The report's rows as one wandb Table, in a run named '<group>-summary' of the sweep's group."""
    import wandb

    group = base.wandb_group or root.name
    cfg = dataclasses.replace(
        base,
        out_dir=str(root),
        wandb_group=group,
        wandb_run_name=f"{group}-summary",
        wandb_tags=["summary"],
    )
    run = start_wandb(cfg, f"{group}-summary")
    columns = list(dict.fromkeys(k for r in rows for k in r))
    run.log(
        {
            "comparison": wandb.Table(
                columns=columns, data=[[r.get(k) for k in columns] for r in rows]
            )
        }
    )
    run.finish()
