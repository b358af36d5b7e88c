"""The attention-variant comparison's report (compare.py), from the runs' log.jsonl files and the
stored speed measurements alone: a row for each variant x size x conversion over its seeds, at the
variant's learning rate of lowest mean final val loss (--lrs), its figures on the test split where
the dataset has one (mean final loss with its 95% interval, the seed-paired difference to MHA,
recall accuracies pooled with Wilson intervals, the runs that solved a recall task), written as
report.md (its tables and verdicts: smallgpt/report_text.py), report.csv, report.png
(smallgpt/plots.py) and (with wandb_log) a wandb Table."""

import csv
import dataclasses
import json
import math
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from model import GPT, GPTConfig
from smallgpt import capacity, runtime, stats
from smallgpt.atomic import atomic_open
from smallgpt.checkpoint import parse_source
from smallgpt.configs import CompareConfig, TrainConfig
from smallgpt.convert import CONVERT_METHODS
from smallgpt.errors import UserError
from smallgpt.plots import conversion_target, plot
from smallgpt.recall import LONG_TASKS
from smallgpt.report_text import kv_column, markdown, shown_metric
from smallgpt.runlog import read_run, start_wandb, unfinished
from smallgpt.sweep import Run
from smallgpt.variant import Variant

SPEED_FILE = "speed.json"


def speed_key(c: GPTConfig, context: int, batch: int) -> str:
    """A shape's key in speed.json: what the cached-step decode speed depends on."""
    if c.attention_type == "MLA":
        kv = f"mla{c.kv_lora_rank}r{c.qk_rope_head_dim}"
    else:
        kv = f"kv{c.n_kv_head}"
    shape = f"{c.n_layer}x{c.n_embd}-h{c.n_head}-{kv}-mlp{c.mlp_hidden}-{c.pos_encoding}"
    # all global attention without options: no suffix, as the keys stored before windows were
    suffix = Variant.from_config(c).suffix
    return f"{shape}{suffix}@{context}x{batch}"


@dataclass(slots=True)
class Speeds:
    """What speed.json holds: the decode speeds by shape (speed_key), and the settings they were
    measured with (speed_settings; None in a file from before they were recorded)."""

    by_shape: dict[str, list[float]]
    settings: dict | None


def read_speeds(root: Path) -> Speeds:
    """The decode speeds the sweep stored in root/speed.json (none yet: empty). A UserError where
    the file is not what the sweep writes (a sweep would merge its measurements into it, a report
    read them)."""
    path = root / SPEED_FILE
    if not path.is_file():
        return Speeds({}, None)
    try:
        stored = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not JSON ({e}): {SPEED_REDO}") from e
    if isinstance(stored, dict) and set(stored) == {"measured_with", "speeds"}:
        speeds = Speeds(stored["speeds"], stored["measured_with"])
    else:  # written before the settings were recorded: the speeds alone
        speeds = Speeds(stored, None)
    numbers = (int, float)
    valid = (
        isinstance(speeds.by_shape, dict)
        and all(
            isinstance(v, list) and all(isinstance(x, numbers) for x in v)
            for v in speeds.by_shape.values()
        )
        and isinstance(speeds.settings, dict | None)
    )
    if not valid:
        raise UserError(f"{path} is not a record of decode speeds by shape: {SPEED_REDO}")
    return speeds


def speed_settings(cfg: CompareConfig, device: str) -> dict:
    """What a decode speed depends on besides the shape (speed_key): where and how it is
    measured. speed.json's speeds are reused only when measured with these."""
    return {
        "device": runtime.device_name(device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "decode_steps": cfg.decode_steps,
    }


# each run's MQAR accuracy by pair count, where the runs trained on a mix (smallgpt/capacity.py)
CAPACITY_FILE = "capacity.csv"

# what to do about a speed.json that compare.py cannot read
SPEED_REDO = "delete it, and the sweep measures the speeds again (nothing was trained or written)"


def read_runs(root: Path, planned: list[Run]) -> tuple[list[dict], list[str]]:
    """The finished runs of planned (the runs the command names: its variants, seeds, sizes, rates
    and conversions; runlog.unfinished: its final evaluation logged whole), read_run's record plus
    what the sweep's tags say of it and the iterations the command plans for it; and the sentences
    naming what is left out (unfinished, not trained yet, or under root but not named by the
    command), also printed on stderr: a run's final val loss is never an earlier evaluation's."""
    named = {run.dir: run for run in planned}
    logged = sorted(p.parent for p in root.glob("*/log.jsonl"))
    dirs = [d for d in named if d in logged]
    notes = left_out_notes(root, planned, [d for d in logged if d not in named])
    if not dirs:
        raise UserError(
            f"no run of this command under {root} (no <run>/log.jsonl of the {len(planned)} it "
            f"names): run the sweep first (--mode=train)"
        )
    runs = [read_run(d) | {"dir": str(d), "planned_iters": named[d].iters} for d in dirs]
    # the runs not finished (stopped, killed, still running), left out
    why = {r["dir"]: reason for r in runs if (reason := unfinished(r))}
    if why:
        unfinished_runs = "; ".join(f"{d} ({w})" for d, w in why.items())
        notes.insert(
            0,
            f"Left out of the report, unfinished: {unfinished_runs}. Run the sweep again "
            f"(--mode=train) to finish them.",
        )
        runs = [r for r in runs if r["dir"] not in why]
    for note in notes:
        print(note, file=sys.stderr)
    if not runs:
        raise UserError(
            f"no run under {root} has finished yet ({len(why)} unfinished): run the sweep "
            f"(--mode=train)"
        )
    for r in runs:
        r |= tagged_as(r)
    return runs, notes


def left_out_notes(root: Path, planned: list[Run], others: list[Path]) -> list[str]:
    """Sentences naming the runs planned that have no log yet, and the run folders under root
    (others) that the command does not name: neither is read."""
    notes = []
    missing = [run.dir.name for run in planned if not (run.dir / "log.jsonl").is_file()]
    if missing:
        notes.append(
            f"Not trained yet, so not in the report: {', '.join(missing)} (of the "
            f"{len(planned)} runs this command names). Run the sweep (--mode=train)."
        )
    if others:
        notes.append(
            f"Not read: {', '.join(d.name for d in others)} under {root}, runs that this command "
            f"does not name (other variants, seeds, sizes, learning rates or conversions than "
            f"its own)."
        )
    return notes


def tagged_as(run: dict) -> dict:
    """What the sweep's tags say of a run (its variant, seed, size, match, conversion), its model
    and its final evaluation."""
    cfg = run["config"]
    mc = run["model_config"]
    tags = cfg.get("wandb_tags") or []
    tagged = dict(t.split("=", 1) for t in tags if "=" in t)  # {'seed': '1337', ...}
    method = None
    if parse_source(cfg["init_from"]).kind == "convert":
        method = tagged.get("convert", cfg.get("convert_method", "mean"))
    # a run that diverged (at a rate of --lrs): an infinite loss, so its rate is never chosen
    diverged = run.get("diverged")
    final = run["evals"][-1] if not diverged else {"val_loss": math.inf, "iter": diverged["iter"]}
    tokens_per_iter = cfg["gradient_accumulation_steps"] * cfg["batch_size"] * cfg["block_size"]
    # trained for other iterations than the command plans (a diverged run stopped early); an
    # early stop at stop_at_accuracy is the budget's rule, not another budget
    stopped = run.get("stopped") is not None
    other_budget = not diverged and not stopped and final["iter"] != run["planned_iters"]
    return {
        "diverged": bool(diverged),
        "other_budget": other_budget,
        "variant": tags[0] if tags and "=" not in tags[0] else run["name"],
        "seed": cfg["seed"],
        "size": tagged.get("size", f"{mc['n_layer']}x{mc['n_embd']}"),
        "match": tagged.get("match", "width"),
        "method": method,
        "fraction": float(tagged["uptrain"]) if "uptrain" in tagged else None,
        "uptrained_by": uptrained_by(cfg) if method is not None else None,
        "model": GPTConfig(**mc),
        "final": final["val_loss"],
        "test": final.get("test_loss"),  # a dataset without a test split: None
        "rate": tagged.get("lr"),  # the learning rate of --lrs it trained at; None: no --lrs
        "iters": final["iter"],
        "tokens": final["iter"] * tokens_per_iter,
    }


def uptrained_by(cfg: dict) -> str:
    """What a conversion's uptraining trained on, from its run config: the data's cross-entropy,
    or a distillation from its teacher (train.py's --distill)."""
    distill = cfg.get("distill", "")
    if distill == "logits":
        ce = cfg.get("distill_ce", 0.0)
        plus = f" + {ce:g} x cross-entropy" if ce else ""
        return f"distillation (KL to the teacher's logits{plus})"
    if distill == "layers":
        return "distillation (each converted layer's MSE to the teacher's attention)"
    return "cross-entropy"


def reported_split(runs: list[dict]) -> str:
    """The split the report's figures are on: test where every run measured one at its end, else
    val (a dataset prepared before test splits); a diverged run measured none."""
    return "test" if all(r["test"] is not None for r in runs if not r["diverged"]) else "val"


@dataclass(slots=True)
class RateChoice:
    """Each size x variant at its chosen learning rate of --lrs (rate_choice)."""

    kept: list[dict]  # the runs at the chosen rates
    # (size, variant) -> {rate: mean final val loss over its seeds}
    means: dict[tuple[str, str], dict]
    # (size, variant) -> {rate: its runs trained for other iterations than planned, with theirs}
    other_budget: dict[tuple[str, str], dict[str, str]]
    lost: list[str]  # '<size> <variant>' of those diverged at every rate (no row)


def rate_choice(runs: list[dict]) -> RateChoice:
    """The runs at each size x variant's chosen learning rate, the one of --lrs with the lowest mean
    final val loss over its seeds (the first of equals; a sweep without --lrs has one, None; a rate
    at which a seed diverged: infinite), and what the choice was made from."""
    by_rate = defaultdict(lambda: defaultdict(list))
    for r in runs:
        by_rate[(r["size"], r["variant"])][r["rate"]].append(r)
    means = {
        k: {rate: statistics.fmean(r["final"] for r in rs) for rate, rs in m.items()}
        for k, m in by_rate.items()
    }
    marked = {k: {rate: other_iters(rs) for rate, rs in m.items()} for k, m in by_rate.items()}
    other_budget = {k: {r: runs for r, runs in m.items() if runs} for k, m in marked.items()}
    chosen = {k: min(m, key=m.get) for k, m in means.items() if min(m.values()) < math.inf}
    lost = [f"{size} {variant}" for size, variant in means if (size, variant) not in chosen]
    kept = [r for r in runs if chosen.get((r["size"], r["variant"]), False) == r["rate"]]
    return RateChoice(kept, means, other_budget, lost)


def summary_rows(
    choice: RateChoice, speeds: dict[str, list[float]], cfg: CompareConfig, split: str
) -> list[dict]:
    """One row per size x variant (conversions: x method x fraction), over its seeds, of runs at
    one learning rate each (rate_choice), its figures on split (cfg: KV and speed settings)."""
    runs = choice.kept
    for r in runs:
        r["reported"] = r["test"] if split == "test" else r["final"]
    by_seed = runs_by_seed(runs)
    groups = {k: list(g.values()) for k, g in by_seed.items()}
    finals = {k: {seed: r["reported"] for seed, r in g.items()} for k, g in by_seed.items()}
    # each group's decode speeds, stored under its shape's key
    speed_of = {}
    for k, group in groups.items():
        key = speed_key(group[0]["model"], cfg.decode_context, cfg.decode_batch)
        speed_of[k] = speeds.get(key, [])
    rows = []
    for (size, name), group in groups.items():
        # what a variant is set beside: MHA's at its size (nothing, for MHA itself)
        vs_mha = name != "mha"
        mha_finals = finals.get((size, "mha")) if vs_mha else None
        mha_speed = speed_of.get((size, "mha"), []) if vs_mha else None
        mha_runs = groups.get((size, "mha")) if vs_mha else None
        # the row's columns, concern by concern
        row = model_columns(size, name, group[0], cfg)
        row |= rate_columns(
            group[0]["rate"],
            choice.means.get((size, name), {}),
            choice.other_budget.get((size, name), {}),
        )
        row |= loss_columns(group, mha_finals, split)
        if group[0]["method"]:
            row |= conversion_columns(group, finals.get((size, conversion_target(row))))
        row |= speed_columns(group, speed_of[(size, name)], mha_speed)
        row |= recall_columns(group, mha_runs, cfg.solved_threshold)
        row |= long_recall_columns(group)
        row |= benchmark_columns(group, mha_runs, cfg.lm_eval, cfg.lm_eval_limit)
        rows.append(row)
    return sorted(rows, key=row_order(rows, cfg))


def runs_by_seed(runs: list[dict]) -> dict[tuple[str, str], dict[int, dict]]:
    """The runs by (size, variant), then by seed: one each, since the runs are the command's own
    (read_runs), one folder per size, variant, rate and seed, at one rate each (rate_choice)."""
    by_seed = defaultdict(dict)
    for r in runs:
        mine = by_seed[(r["size"], r["variant"])]
        assert r["seed"] not in mine, f"two runs of {r['variant']} at seed {r['seed']}"
        mine[r["seed"]] = r
    return by_seed


def model_columns(size: str, name: str, first: dict, cfg: CompareConfig) -> dict:
    """What a row is: its size and variant, how its runs were made (first: one of them), its
    model's parameters and KV-cache bytes."""
    m = first["model"]
    with torch.device("meta"):
        model = GPT(m)
    kv_dtype = getattr(torch, cfg.kv_dtype)
    # one sequence at the decode speed's context, and the batch at the sequence length asked for
    kv_bytes = m.kv_cache_bytes(1, cfg.decode_context, kv_dtype)
    kv_bytes_long = m.kv_cache_bytes(cfg.kv_batch, cfg.kv_seq_len, kv_dtype)
    return {
        "size": size,
        "variant": name,
        "n_head": m.n_head,
        "n_kv_head": m.n_kv_head,
        "kv_lora_rank": m.kv_lora_rank,
        "recurrent_layers": len(m.recurrent_layers),  # the layers that do not attend
        "layers": m.layer_letters,  # each layer's kind by its letter (model.LAYER_KINDS)
        "attention_share": 1 - len(m.recurrent_layers) / m.n_layer,
        "match": first["match"],
        "method": first["method"],
        "uptrain_fraction": first["fraction"],
        "uptrained_by": first["uptrained_by"],
        "params": model.num_params(),
        "mlp_hidden": m.mlp_hidden,
        "attention_params": model.mixing_params(),  # every layer's: attention or recurrent
        kv_column(cfg): kv_bytes,
        f"kv_bytes@{cfg.kv_seq_len}x{cfg.kv_batch}": kv_bytes_long,
    }


def rate_columns(rate: str | None, means: dict, other_budget: dict[str, str]) -> dict:
    """A row's learning rate of --lrs (the chosen), its mean final val loss at each it trained
    at ('0.001:1.5200 0.003:1.4800') and the rates whose runs include some trained for other
    iterations than planned, with those runs ('0.003=gqa2-lr0.003-s1337 200'); none for a sweep
    without --lrs."""
    if rate is None:
        return {}
    return {
        "lr": rate,
        # a rate at which a seed diverged: 'inf'
        "val_loss_by_lr": " ".join(f"{r}:{loss:.4f}" for r, loss in means.items()),
        "lr_other_iters": "; ".join(f"{r}={runs}" for r, runs in other_budget.items()) or None,
    }


def loss_columns(group: list[dict], mha_finals: dict[int, float] | None, split: str) -> dict:
    """A group's budget and final val loss over its seeds, its final test loss where split is
    test, and its seed-paired difference to MHA's on split (mha_finals: {seed: loss}; None for MHA
    itself)."""
    first = group[0]
    est = stats.mean_interval([r["final"] for r in group])
    diff = None
    if mha_finals is not None:
        diff = stats.paired_difference({r["seed"]: r["reported"] for r in group}, mha_finals)
    test = {}
    if split == "test":
        on_test = stats.mean_interval([r["test"] for r in group])
        test = {
            "test_loss": on_test.mean,
            "test_loss_ci95": on_test.half_width,
            "test_loss_by_seed": " ".join(f"{r['test']:.4f}" for r in group),
        }
    return {
        "split": split,
        "iters": first["iters"],
        "iters_by_seed": " ".join(str(r["iters"]) for r in group),
        "other_iters": other_iters(group),
        "tokens": first["tokens"],
        "seeds": est.n,
        "val_loss": est.mean,
        "val_loss_ci95": est.half_width,
        "val_loss_by_seed": " ".join(f"{r['final']:.4f}" for r in group),
        **test,
        "diff_vs_mha": diff and diff.mean,
        "diff_vs_mha_ci95": diff and diff.half_width,
        "diff_pairs": diff and diff.n,
    }


def conversion_columns(group: list[dict], scratch: dict[int, float] | None) -> dict:
    """A conversion's val loss right after converting, and its seed-paired difference to its
    target trained from scratch (scratch: that variant's {seed: final loss on the reported split},
    None if none)."""
    after = stats.mean_interval([r["evals"][0]["val_loss"] for r in group])
    vs = None
    if scratch:
        vs = stats.paired_difference({r["seed"]: r["reported"] for r in group}, scratch)
    return {
        "val_loss_after_conversion": after.mean,
        "scratch_loss": scratch and statistics.fmean(scratch.values()),
        "diff_vs_scratch": vs and vs.mean,
        "diff_vs_scratch_ci95": vs and vs.half_width,
        "diff_vs_scratch_pairs": vs and vs.n,
    }


def speed_columns(group: list[dict], speed: list[float], mha_speed: list[float] | None) -> dict:
    """A group's decode speed over the repeats (speed) and its ratio to MHA's (mha_speed; None for
    MHA itself), its training speed and its wall time."""
    speed_vs = None
    if mha_speed is not None:
        speed_vs = stats.speed_ratio(speed, mha_speed)
    trains = [
        statistics.median(t["tokens_per_s"] for t in r["trains"]) for r in group if r["trains"]
    ]
    # each run's wall time: its last record's
    walls = [max(e["wall_s"] for e in r["evals"] + r["trains"]) for r in group]
    return {
        "decode_tok_s": statistics.median(speed) if speed else None,
        "decode_tok_s_min": min(speed, default=None),
        "decode_tok_s_max": max(speed, default=None),
        "decode_repeats": len(speed),
        "decode_vs_mha": speed_vs and speed_vs.ratio,
        "decode_vs_mha_low": speed_vs and speed_vs.low,
        "decode_vs_mha_high": speed_vs and speed_vs.high,
        "decode_vs_mha_pairs": speed_vs and speed_vs.n,
        "train_tok_s": statistics.median(trains) if trains else None,
        "wall_s": statistics.fmean(walls),
    }


def row_order(rows: list[dict], cfg: CompareConfig) -> Callable[[dict], tuple]:
    """The rows' order: sizes by their smallest model; in a size, the variants from scratch before
    the conversions, each by KV-cache bytes, most first (MHA), width before params, then the
    conversion methods in CONVERT_METHODS' order, by uptraining fraction."""
    sizes = {r["size"] for r in rows}
    smallest = {size: min(r["params"] for r in rows if r["size"] == size) for size in sizes}
    methods = {m: i for i, m in enumerate(CONVERT_METHODS)}
    kv = kv_column(cfg)

    def key(r: dict) -> tuple:
        return (
            smallest[r["size"]],
            r["size"],
            r["method"] is not None,
            -r[kv],
            r["match"] == "params",
            methods.get(r["method"], -1),
            r["uptrain_fraction"] or 0,
        )

    return key


def other_iters(group: list[dict]) -> str | None:
    """'gqa2-s1338 60': the runs of group trained for other iterations than the command plans
    for them (its budget: max_iters, or a conversion's fraction of it), with their iterations."""
    named = [f"{Path(r['dir']).name} {r['iters']}" for r in group if r["other_budget"]]
    return "; ".join(named) or None


def recall_columns(group: list[dict], mha: list[dict] | None, threshold: float) -> dict:
    """A group's recall columns where every run measured the task: induction at the longest common
    distance, MQAR (threshold: the accuracy at which a run counts as having solved a task)."""
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
            **accuracy_columns("induction_acc", at, mha_at, threshold),
        }
    if all("mqar" in rec for rec in recalls.values()):
        out |= accuracy_columns(
            "mqar_acc",
            {seed: rec["mqar"] for seed, rec in recalls.items()},
            {seed: rec["mqar"] for seed, rec in theirs.items() if "mqar" in rec},
            threshold,
        )
    return out


def long_recall_columns(group: list[dict]) -> dict:
    """A group's columns of recall past the trained length (recall.LONG_TASKS, each where every
    run measured it): at each cell all the runs share (long_cell: a length; the needle's, a length
    and a depth), the examples solved pooled over the seeds, of all (<task>_solved@<cell>,
    <task>_n@<cell>), and each seed's count in seed order (<task>_by_seed@<cell>)."""
    runs = sorted(group, key=lambda r: r["seed"])
    out = {}
    for task in LONG_TASKS:
        measured = [(r["recall"] or {}).get(task) for r in runs]
        if not all(measured):
            continue
        by_cell = [{long_cell(c): c for c in results} for results in measured]
        common = set.intersection(*(set(cells) for cells in by_cell))
        for cell in [c for c in by_cell[0] if c in common]:
            counts = [cells[cell] for cells in by_cell]
            out |= {
                f"{task}_solved@{cell}": sum(c["solved"] for c in counts),
                f"{task}_n@{cell}": sum(c["n"] for c in counts),
                f"{task}_by_seed@{cell}": " ".join(str(c["solved"]) for c in counts),
            }
    return out


def long_cell(result: dict) -> str:
    """A long-recall result's cell: '504' (its length in tokens), or '504@0.25' where it has a
    depth (the needle's: 0 the first token, 1 just before the question)."""
    if "depth" in result:
        return f"{result['length']}@{result['depth']:g}"
    return str(result["length"])


def benchmark_columns(
    group: list[dict], mha: list[dict] | None, tasks: list[str], limit: int | None
) -> dict:
    """A group's columns of each harness task of tasks (compare.py --lm_eval, scored by eval.py)
    that every run of it scored at limit (items; None: all): each metric's mean over the seeds with
    its 95% Student t interval (<task>_<metric>, _ci95), and its seed-paired difference to MHA's
    (mha: MHA's runs at this size; None for MHA itself)."""

    def scores(run: dict, task: str) -> dict | None:
        return (run.get("benchmarks") or {}).get(task, {}).get(limit)

    out = {}
    for task in tasks:
        scored = [scores(r, task) for r in group]
        if not all(scored):
            continue
        theirs = {r["seed"]: scores(r, task) or {} for r in mha or []}
        for metric in benchmark_metrics(scored):
            values = {r["seed"]: s[metric] for r, s in zip(group, scored, strict=True)}
            est = stats.mean_interval(list(values.values()))
            mha_values = {seed: s[metric] for seed, s in theirs.items() if metric in s}
            diff = stats.paired_difference(values, mha_values) if mha is not None else None
            key = f"{task}_{metric}"
            out |= {
                key: est.mean,
                f"{key}_ci95": est.half_width,
                f"{key}_diff_vs_mha": diff and diff.mean,
                f"{key}_diff_vs_mha_ci95": diff and diff.half_width,
                f"{key}_diff_pairs": diff and diff.n,
            }
    return out


def unscored_notes(
    runs: list[dict], rows: list[dict], tasks: list[str], limit: int | None
) -> list[str]:
    """A sentence for each harness task of tasks (compare.py --lm_eval) that no row has a column
    of, since no run has its score at limit (items; None: all), or no variant every seed's: which
    runs have one, and how to score them, rather than a column silently left out."""
    notes = []
    at = " (all items)" if limit is None else f" at lm_eval_limit={limit}"
    limit_flag = "" if limit is None else f" --lm_eval_limit={limit}"
    for task in tasks:
        if shown_metric(rows, task) is not None:
            continue
        logged = [(r.get("benchmarks") or {}).get(task, {}) for r in runs]
        scored = sum(limit in by_limit for by_limit in logged)
        if scored == len(runs):
            continue  # scored, but no metric the runs share: nothing to show
        if scored == 0:
            elsewhere = sum(bool(by_limit) for by_limit in logged)
            other = f" ({elsewhere} have one at another limit)" if elsewhere else ""
            what = f"No run has a score of {task}{at}{other}"
        else:
            what = (
                f"Only {scored} of {len(runs)} runs have a score of {task}{at}, no variant every "
                "seed's"
            )
        notes.append(
            f"{what}, so the report has no column of it: run the sweep again with "
            f"--lm_eval=[{task}]{limit_flag} (this command's other flags, --mode=train or all: "
            "it scores the runs trained already, without training them again)."
        )
    return notes


def benchmark_metrics(scored: list[dict]) -> list[str]:
    """The metrics every one of scored (a task's results, one per run) has, in the first's order:
    its scores (acc, acc_norm, perplexity...), not their standard errors, item counts, limit or the
    scorer's check."""
    first = scored[0]
    return [
        m
        for m in first
        if not m.endswith("_stderr")
        and not m.startswith("check_")
        and m not in ("n", "limit")
        and all(isinstance(s.get(m), int | float) for s in scored)
    ]


def accuracy_columns(
    name: str, results: dict[int, dict], mha: dict[int, dict], threshold: float
) -> dict:
    """name's columns from stats.pooled_accuracy of the seeds' results against MHA's, and from
    stats.solved: the runs whose accuracy reached threshold, of all."""
    acc = stats.pooled_accuracy(results, mha)
    won = stats.solved([r["correct"] / r["n"] for r in results.values()], threshold)
    task = name.removesuffix("_acc")
    return {
        f"{task}_solved": won.k,
        f"{task}_runs": won.n,
        f"{task}_solved_low": won.low,
        f"{task}_solved_high": won.high,
        f"{name}_of_solved": won.accuracy,
        name: acc.accuracy,
        f"{name}_low": acc.low,
        f"{name}_high": acc.high,
        f"{name}_diff_vs_mha": acc.diff and acc.diff.mean,
        f"{name}_diff_vs_mha_ci95": acc.diff and acc.diff.half_width,
    }


def write_report(
    root: Path, cfg: CompareConfig, base: TrainConfig, planned: list[Run], status: str | None = None
) -> str:
    """report.md, report.csv and report.png under root from the logs of the runs planned (those
    the command names), and, with base.wandb_log, the rows as a wandb Table in one more run of the
    sweep's group; returns report.md's text, which starts with status (the sweep still running)
    and the runs left out, if any."""
    runs, left_out = read_runs(root, planned)
    speeds = read_speeds(root).by_shape

    split = reported_split(runs)
    choice = rate_choice(runs)
    rows = summary_rows(choice, speeds, cfg, split)
    notes = [status] if status else []
    notes += left_out
    if choice.lost:
        notes.append(
            f"Diverged at every rate of --lrs (no row): {', '.join(choice.lost)}. Give lower rates."
        )
    if split == "val":
        notes.append(
            "The dataset has no test split (prepared before there were any): every figure below is "
            "on its val split, the one any choice of learning rate was made on; prepare it again "
            "for a test split."
        )
    notes += unscored_notes(choice.kept, rows, cfg.lm_eval, cfg.lm_eval_limit)
    text = markdown(rows, cfg, root, notes, SPEED_FILE)
    # trained on a mix of pair counts (data/mqar --pairs_mix): each variant's capacity curve
    results = capacity.results_of([r for r in runs if not r["method"]])
    curves = capacity.curves(capacity.sized(results), cfg.solved_threshold) if results else {}
    if curves:
        capacity.write_results(root / CAPACITY_FILE, results)
        text += capacity.section(curves, cfg.solved_threshold, CAPACITY_FILE)
    with atomic_open(root / "report.md", "w") as f:
        f.write(text)
    with atomic_open(root / "report.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        writer.writerows(rows)
    plot(choice.kept, rows, root / "report.png", curves)
    if base.wandb_log:
        log_table(rows, base, root)
    return text


def log_table(rows: list[dict], base: TrainConfig, root: Path) -> None:
    """The report's rows as one wandb Table, in a run named '<group>-summary' of the sweep's
    group."""
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
    data = [[r.get(k) for k in columns] for r in rows]
    run.log({"comparison": wandb.Table(columns=columns, data=data)})
    run.finish()
