"""Compare attention variants: train MHA, GQA and MQA versions of one config, then report what each costs and scores.

    python compare.py config/compare/cpu.py                # sweep + report in the config's out_dir
    python compare.py config/compare/cpu.py --convert=True # also MHA -> GQA/MQA conversion + uptraining
    python compare.py config/compare/cpu.py --mode=report  # the report alone, from the runs' log.jsonl files
    python compare.py config/train_gpt2.py --mode=costs    # parameters and KV-cache bytes of every n_kv_head

Positional arguments and --key=value flags of train.py's TrainConfig describe the base run; the keys below steer
the comparison. Each variant trains in <out_dir>/<name> with wandb group <out_dir name> and a tag naming it.
"""

import csv
import dataclasses
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from atomic import atomic_open
from checkpoint import load_checkpoint, model_from_checkpoint
from configurator import UserError, parse_config, run_cli, split_args
from dataset import vocab_size_of
from measure import cached_step_throughput, default_kv_heads, table, timed_decode
from model import GPT, GPTConfig
from runlog import read_run
from runtime import resolve_device
from train import TrainConfig


@dataclass(slots=True)
class CompareConfig:
    mode: str = "all"  # 'train' (the sweep), 'report', 'all' (both) or 'costs' (a table, no training)
    kv_heads: list[int] = field(default_factory=list)  # the variants; empty: n_head, a middle divisor, 1
    convert: bool = False  # also convert the trained MHA model to each GQA/MQA variant and uptrain it
    uptrain_fraction: float = 0.1  # uptraining length, as a fraction of the base run's max_iters
    kv_seq_len: int = 8192  # the KV-cache column for a sequence length and batch of your choice
    kv_batch: int = 8
    kv_dtype: str = "bfloat16"
    decode_tokens: int = 256  # decode speed on each trained checkpoint: batch 1, greedy, this many tokens
    # decode speed where the KV cache dominates what a step reads: this batch, this many positions cached (each
    # variant's shape with random weights, float32; decode_steps one-token steps, the median reported)
    decode_batch: int = 8
    decode_context: int = 4096
    decode_steps: int = 16
    train_args: list[str] = field(default_factory=list)  # filled from the command line: files and train.py flags

    def __post_init__(self) -> None:
        if self.mode not in ("train", "report", "all", "costs"):
            raise ValueError(f"mode={self.mode!r} must be one of train, report, all, costs")
        if self.kv_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"kv_dtype={self.kv_dtype!r} must be float32, bfloat16 or float16")
        sizes = ("kv_seq_len", "kv_batch", "decode_tokens", "decode_batch", "decode_context", "decode_steps")
        if bad := [f"{k}={getattr(self, k)}" for k in sizes if getattr(self, k) < 1]:
            raise ValueError(f"{', '.join(bad)}: must be positive")
        if min(self.kv_heads, default=1) < 1 or self.uptrain_fraction <= 0:
            raise ValueError(f"kv_heads={self.kv_heads} and uptrain_fraction={self.uptrain_fraction} must be positive")


def variant(base: TrainConfig, n_kv_head: int, vocab_size: int = 1) -> GPTConfig:
    """The base run's model with n_kv_head K/V heads."""
    return dataclasses.replace(base.model_config(vocab_size), n_kv_head=n_kv_head)


def variant_name(config: GPTConfig) -> str:
    """'mha', 'gqa<n_kv_head>' or 'mqa'."""
    kind = config.attention_kind.lower()
    return f"gqa{config.n_kv_head}" if kind == "gqa" else kind


def train_runs(cfg: CompareConfig, base: TrainConfig) -> None:
    """Train every variant (and, with convert, every MHA -> GQA/MQA conversion) one after another."""
    root, group = Path(base.out_dir), base.wandb_group or Path(base.out_dir).name
    for g in cfg.kv_heads:
        name = variant_name(variant(base, g))
        launch(cfg.train_args + [f"--n_kv_head={g}", f"--wandb_group={group}", f"--wandb_tags={name},n_kv_head={g}"],
               root / name)
    if not cfg.convert:
        return
    iters = max(1, round(base.max_iters * cfg.uptrain_fraction))
    for g in cfg.kv_heads:
        if g != base.n_head:
            name = f"mha-to-{variant_name(variant(base, g))}"
            launch(cfg.train_args + [f"--init_from=convert:{root / 'mha'}", f"--n_kv_head={g}",
                                     f"--max_iters={iters}", f"--lr_decay_iters={iters}",
                                     f"--warmup_iters={min(base.warmup_iters, iters // 10)}",
                                     f"--eval_interval={max(1, iters // 4)}", "--always_save_checkpoint=True",
                                     f"--wandb_group={group}", f"--wandb_tags={name},converted,n_kv_head={g}"],
                   root / name)


def launch(args: list[str], out_dir: Path) -> None:
    """python train.py args into out_dir; a run that already has a checkpoint there (a sweep run again, or cut
    short) resumes it: it trains on to max_iters, or says it is done."""
    args = args + [f"--out_dir={out_dir}"] + ["--init_from=resume"] * (out_dir / "ckpt.pt").exists()
    print(f"$ python train.py {' '.join(args)}", flush=True)
    if subprocess.run([sys.executable, str(Path(__file__).with_name("train.py")), *args]).returncode:
        raise UserError(f"the training run into {out_dir} failed: see its output above")


def decode_speed(run_dir: Path, tokens: int) -> float:
    model = model_from_checkpoint(load_checkpoint(run_dir / "ckpt.pt")).to(resolve_device("auto")).eval()
    timed_decode(model, 1, 8, True, torch.Generator().manual_seed(0))  # warm-up
    return tokens / timed_decode(model, 1, tokens, True, torch.Generator().manual_seed(0))[-1]


def report_rows(cfg: CompareConfig, runs: list[dict]) -> list[dict]:
    rows, kv_dtype, long = [], getattr(torch, cfg.kv_dtype), f"{cfg.decode_context}x{cfg.decode_batch}"
    by_name = {r["name"]: r for r in runs}
    for run in runs:
        mcfg = GPTConfig(**run["model_config"])
        with torch.device("meta"):
            model = GPT(mcfg)
        evals = run["evals"]
        row = {"variant": run["name"], "n_head": mcfg.n_head, "n_kv_head": mcfg.n_kv_head,
               "params": model.num_params(), "attention_params": model.attention_params_per_layer() * mcfg.n_layer,
               f"kv_bytes@{mcfg.block_size}": mcfg.kv_cache_bytes(1, mcfg.block_size, kv_dtype),
               f"kv_bytes@{cfg.kv_seq_len}x{cfg.kv_batch}": mcfg.kv_cache_bytes(cfg.kv_batch, cfg.kv_seq_len, kv_dtype),
               "best_val_loss": min(e["val_loss"] for e in evals), "final_val_loss": evals[-1]["val_loss"],
               "wall_s": max(e["wall_s"] for e in evals + run["trains"]),
               "train_tok_s": statistics.median(t["tokens_per_s"] for t in run["trains"]) if run["trains"] else None,
               "decode_tok_s": decode_speed(Path(run["dir"]), cfg.decode_tokens),
               f"kv_bytes_fp32@{long}": mcfg.kv_cache_bytes(cfg.decode_batch, cfg.decode_context),
               f"decode_tok_s@{long}": cached_step_throughput(mcfg, cfg.decode_batch, cfg.decode_context,
                                                              cfg.decode_steps, resolve_device("auto"))}
        if run["config"]["init_from"].startswith("convert:"):
            scratch = by_name.get(variant_name(mcfg))
            row |= {"val_loss_after_conversion": evals[0]["val_loss"],
                    "scratch_final_val_loss": scratch["evals"][-1]["val_loss"] if scratch else None}
        rows.append(row)
    return rows


def plot(runs: list[dict], rows: list[dict], speed_key: str, path: Path) -> None:
    """Val loss by iteration and by wall-clock time per variant, and each variant's final val loss against its
    decode speed at long context (one point each)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_iter, by_time, by_speed) = plt.subplots(1, 3, figsize=(16, 4))
    for run in runs:
        evals = run["evals"]
        it0, t0 = run["offset"]
        losses = [e["val_loss"] for e in evals]
        by_iter.plot([it0 + e["iter"] for e in evals], losses, marker=".", label=run["name"])
        by_time.plot([t0 + e["wall_s"] for e in evals], losses, marker=".", label=run["name"])
    # the y range leaves out the untrained models' first evaluation, which would flatten everything else
    shown = [e["val_loss"] for r in runs for e in r["evals"] if e["iter"] > 0 or r["offset"][0] > 0]
    for ax, xlabel in ((by_iter, "iteration"), (by_time, "wall-clock seconds")):
        ax.set_ylim(min(shown) * 0.98, max(shown) * 1.05)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("val loss")
        ax.grid(alpha=0.3)
        ax.legend()
    for row in rows:
        by_speed.scatter(row[speed_key], row["final_val_loss"])
        by_speed.annotate(row["variant"], (row[speed_key], row["final_val_loss"]), textcoords="offset points",
                          xytext=(4, 4), fontsize=8)
    by_speed.set_xlabel(f"decode tokens/s, {speed_key.split('@')[1]} (context x batch)")
    by_speed.set_ylabel("final val loss")
    by_speed.grid(alpha=0.3)
    fig.suptitle("val loss by attention variant; quality against decode speed")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(cfg: CompareConfig, root: Path) -> str:
    dirs = sorted(p.parent for p in root.glob("*/log.jsonl"))
    if not dirs:
        raise UserError(f"no runs under {root} (no */log.jsonl): run the sweep first (--mode=train)")
    runs = [read_run(d) | {"dir": str(d)} for d in dirs]
    if unevaluated := [r["dir"] for r in runs if not r["evals"]]:  # e.g. a run stopped before its first evaluation
        print(f"left out of the report, no evaluation logged yet: {', '.join(unevaluated)}", file=sys.stderr)
        runs = [r for r in runs if r["evals"]]
    if not runs:
        raise UserError(f"no run under {root} has logged an evaluation yet")
    runs.sort(key=lambda r: (r["config"]["init_from"] != "scratch", -r["model_config"]["n_kv_head"]))
    for run in runs:  # a converted run continues its source's curve in the plot
        src = next((r for r in runs if Path(r["dir"]) == Path(run["config"]["init_from"].removeprefix("convert:"))),
                   None)
        run["offset"] = (src["evals"][-1]["iter"], src["evals"][-1]["wall_s"]) if src else (0, 0.0)
    rows = report_rows(cfg, runs)
    text = table(rows)
    device = resolve_device("auto")
    long = f"{cfg.decode_context}x{cfg.decode_batch}"
    notes = (f"KV-cache bytes in {cfg.kv_dtype}: per sequence at block_size, and for batch {cfg.kv_batch} at "
             f"{cfg.kv_seq_len} tokens. decode_tok_s: the trained checkpoint, batch 1, greedy, {cfg.decode_tokens} "
             f"tokens with the KV cache, on {device}. decode_tok_s@{long}: one-token steps with {cfg.decode_context} "
             f"positions cached for each of {cfg.decode_batch} rows (median of {cfg.decode_steps} steps; the "
             f"variant's shape with random weights, float32, on {device}), next to that cache's bytes "
             f"(kv_bytes_fp32@{long}). wall_s: the run's own training time (a converted run's uptraining only).")
    with atomic_open(root / "report.md", "w") as f:
        f.write(f"{text}\n\n{notes}\n\n![val loss](report.png)\n")
    with atomic_open(root / "report.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        writer.writerows(rows)
    plot(runs, rows, f"decode_tok_s@{cfg.decode_context}x{cfg.decode_batch}", root / "report.png")
    print(f"{text}\n\nwrote {root / 'report.md'}, {root / 'report.csv'}, {root / 'report.png'}")
    return text


def costs(cfg: CompareConfig, base: TrainConfig) -> str:
    """Parameters and KV-cache bytes for every n_kv_head that divides n_head (no training)."""
    vocab = vocab_size_of(base.dataset) or 50304  # GPT-2's, padded
    rows = []
    for g in sorted({d for d in range(1, base.n_head + 1) if base.n_head % d == 0}, reverse=True):
        mcfg = variant(base, g, vocab)
        with torch.device("meta"):
            model = GPT(mcfg)
        kv = mcfg.kv_cache_bytes(1, mcfg.block_size, getattr(torch, cfg.kv_dtype))
        rows.append({"n_kv_head": g, "kind": mcfg.attention_kind, "params (M)": round(model.num_params() / 1e6, 2),
                     "attention params/layer": model.attention_params_per_layer(),
                     f"KV cache/sequence @ {mcfg.block_size} ({cfg.kv_dtype}, MiB)": round(kv / 2**20, 2)})
    text = table(rows)
    print(text)
    return text


def parse(argv: list[str]) -> tuple[CompareConfig, TrainConfig]:
    ours, train_args = split_args(argv, CompareConfig)
    cfg = dataclasses.replace(parse_config(CompareConfig, ours), train_args=train_args)
    base = parse_config(TrainConfig, train_args)
    cfg.kv_heads = cfg.kv_heads or default_kv_heads(base.n_head)
    for g in cfg.kv_heads:  # each variant must be a valid model before anything trains
        try:
            variant(base, g)
        except ValueError as e:
            raise UserError(f"kv_heads={cfg.kv_heads}: {e}") from e
    return cfg, base


def main(config: tuple[CompareConfig, TrainConfig]) -> None:
    cfg, base = config
    if cfg.mode == "costs":
        costs(cfg, base)
        return
    if cfg.mode in ("train", "all"):
        train_runs(cfg, base)
    if cfg.mode in ("report", "all"):
        report(cfg, Path(base.out_dir))


if __name__ == "__main__":
    run_cli(main, parse, keys=(CompareConfig, TrainConfig))
