"""The runs of an attention-variant sweep (compare.py): every variant, size, seed and MHA -> GQA/MQA conversion as
the train.py command that makes it, what each is estimated to cost, and launching them one after another with
progress. A run's tags carry what the report needs to group it (variant, seed, size, match, conversion).
"""

import dataclasses
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from configurator import UserError
from model import GPT, GPTConfig
from runlog import read_run

# named --sizes: (n_layer, n_embd)
SIZE_PRESETS = {"tiny": (2, 64), "mini": (4, 128), "small": (6, 256), "medium": (8, 384)}
STARTUP_S = 6.0  # a train.py process's start (imports, data, model) and end, in the plan's estimate


@dataclass(slots=True)
class Run:
    name: str  # the variant across seeds: 'mha', 'mqa-params', 'mha-to-gqa2-first-u0.05'
    seed: int
    size: str  # '<n_layer>x<n_embd>'
    dir: Path
    model: GPTConfig  # its shape, with the dataset's vocab_size
    args: list[str]  # train.py's arguments, out_dir aside
    iters: int  # its last iteration (0: a conversion evaluated without training)
    evals: int  # evaluations it logs
    tokens_per_iter: int

    @property
    def shape(self) -> tuple[int, ...]:
        m = self.model
        return m.n_layer, m.n_embd, m.n_head, m.n_kv_head, m.mlp_hidden


def variant_name(config: GPTConfig) -> str:
    """'mha', 'gqa<n_kv_head>' or 'mqa'."""
    kind = config.attention_kind.lower()
    return f"gqa{config.n_kv_head}" if kind == "gqa" else kind


def sizes(size_list: list, base: Any) -> list[tuple[str, Any]]:
    """(label, the base run at that size) for each of --sizes ((n_layer, n_embd), 'LxD' or a preset name); none
    given: the base run's own size."""
    out = []
    for s in size_list or [(base.n_layer, base.n_embd)]:
        if isinstance(s, str):
            match = re.fullmatch(r"(\d+)x(\d+)", s)
            if not match and s not in SIZE_PRESETS:
                raise UserError(f"sizes: {s!r} is neither n_layer x n_embd (e.g. 4x128) nor a preset "
                                f"({', '.join(f'{k}={L}x{D}' for k, (L, D) in SIZE_PRESETS.items())})")
            s = SIZE_PRESETS[s] if s in SIZE_PRESETS else tuple(map(int, match.groups()))
        if len(s) != 2:
            raise UserError(f"sizes: {s!r} must be (n_layer, n_embd)")
        n_layer, n_embd = s
        try:
            out.append((f"{n_layer}x{n_embd}", dataclasses.replace(base, n_layer=n_layer, n_embd=n_embd)))
        except ValueError as e:
            raise UserError(f"sizes: {n_layer}x{n_embd}: {e}") from e
    if len({label for label, _ in out}) < len(out):
        raise UserError(f"sizes={size_list}: a size is listed twice")
    return out


def matched_mlp_hidden(reference: GPTConfig, config: GPTConfig) -> int:
    """The MLP width that gives config as many parameters as reference, within 1% (the MQA paper's compensation,
    https://arxiv.org/abs/1911.02150 s3: a wider feed-forward layer)."""
    def count(hidden: int) -> int:
        with torch.device("meta"):
            return GPT(dataclasses.replace(config, mlp_hidden=hidden)).num_params()

    with torch.device("meta"):
        target = GPT(reference).num_params()
    h0 = config.mlp_hidden
    hidden = h0 + round((target - count(h0)) / (count(h0 + 1) - count(h0)))
    if hidden < 1 or abs(count(hidden) - target) > 0.01 * target:
        raise UserError(f"match=params: no MLP width gives {variant_name(config)} at {config.n_layer}x{config.n_embd} "
                        f"MHA's {target:,} parameters within 1% (nearest: mlp_hidden={max(hidden, 1)}, "
                        f"{count(max(hidden, 1)):,}); use --match=width")
    return hidden


def evaluations(iters: int, interval: int, at_start: bool) -> int:
    """How many evaluations train.py logs in a run of iters iterations."""
    return len(set(range(0 if at_start else interval, iters + 1, interval)) | {iters})


def plan(cfg: Any, base: Any, vocab_size: int, root: Path) -> list[Run]:
    """Every run of the sweep, in the order it trains: per size and seed, the scratch variants (MHA first), then
    the conversions of that seed's MHA model. cfg: compare.py's CompareConfig; base: train.py's TrainConfig."""
    return [run for label, sbase in sizes(cfg.sizes, base) for seed in range(base.seed, base.seed + cfg.seeds)
            for run in seed_runs(cfg, sbase, label if cfg.sizes else None, seed, vocab_size, root)]


def seed_runs(cfg: Any, base: Any, label: str | None, seed: int, vocab_size: int, root: Path) -> list[Run]:
    """One seed's runs of base (at a size of --sizes named label, or at its own)."""
    mha = dataclasses.replace(base.model_config(vocab_size), n_kv_head=base.n_head)
    size = f"{base.n_layer}x{base.n_embd}"
    common = cfg.train_args + [f"--n_layer={base.n_layer}", f"--n_embd={base.n_embd}"] * (label is not None) + \
        [f"--seed={seed}", f"--wandb_group={base.wandb_group or root.name}"]

    def run(name: str, model: GPTConfig, args: list[str], tags: list[str], iters: int, evals: int) -> Run:
        tags = [name, f"seed={seed}", f"size={size}", f"n_kv_head={model.n_kv_head}", *tags]
        return Run(name, seed, size, root / f"{label + '-' if label else ''}{name}-s{seed}", model,
                   common + [f"--n_kv_head={model.n_kv_head}", f"--wandb_tags={','.join(tags)}", *args], iters, evals,
                   base.gradient_accumulation_steps * base.batch_size * base.block_size)

    runs, evals = [], evaluations(base.max_iters, base.eval_interval, base.eval_at_start)
    for g in cfg.kv_heads:
        for match in cfg.match if g != mha.n_head else ["width"]:
            model = dataclasses.replace(mha, n_kv_head=g)
            if match == "params":
                model = dataclasses.replace(model, mlp_hidden=matched_mlp_hidden(mha, model))
            runs.append(run(variant_name(model) + "-params" * (match == "params"), model,
                            [f"--mlp_hidden={model.mlp_hidden}"] * (match == "params"), [f"match={match}"],
                            base.max_iters, evals))
    for g in (g for g in cfg.kv_heads if cfg.convert and g != mha.n_head):
        source, target = next(r for r in runs if r.name == "mha"), dataclasses.replace(mha, n_kv_head=g)
        for method in cfg.convert_methods:
            for fraction in cfg.uptrain_fractions:
                iters = round(fraction * base.max_iters)
                runs.append(run(f"mha-to-{variant_name(target)}-{method}-u{fraction:g}", target,
                                [f"--init_from=convert:{source.dir}", f"--convert_method={method}",
                                 *uptraining(base, iters, cfg.uptrain_lr_scale)],
                                ["match=width", "converted", f"convert={method}", f"uptrain={fraction:g}"], iters,
                                1 if iters == 0 else 2))
    return runs


def uptraining(base: Any, iters: int, lr_scale: float) -> list[str]:
    """train.py's schedule for uptraining a converted model for iters iterations (0: evaluate it only): its own
    linear warm-up over a tenth of them (at the peak learning rate at once, the converted model's loss first rises),
    peak learning rates lr_scale times the base run's, cosine decay; evaluated at the start and the end."""
    if iters == 0:
        return ["--eval_only=True", "--max_iters=0"]
    return [f"--max_iters={iters}", f"--lr_decay_iters={iters}", f"--warmup_iters={max(1, iters // 10)}",
            f"--learning_rate={base.learning_rate * lr_scale:g}", f"--muon_lr={base.muon_lr * lr_scale:g}",
            f"--min_lr={base.min_lr * lr_scale:g}", f"--eval_interval={iters}", "--eval_at_start=True",
            "--always_save_checkpoint=True"]


def finished(run: Run) -> bool:
    """Whether run's log holds its final evaluation (and, for a run that trains, a checkpoint)."""
    if not (run.dir / "log.jsonl").is_file() or (run.iters and not (run.dir / "ckpt.pt").is_file()):
        return False
    try:
        return any(e["iter"] == run.iters for e in read_run(run.dir)["evals"])
    except (UserError, KeyError):
        return False


def estimate(run: Run, timings: dict[tuple, tuple[float, float]], eval_iters: int) -> float:
    """Seconds run is expected to take, from its shape's timed training step and evaluation batch."""
    step_s, eval_s = timings[run.shape]
    return STARTUP_S + run.iters * step_s + run.evals * 2 * eval_iters * eval_s


def launch_all(runs: list[Run], timings: dict[tuple, tuple[float, float]], eval_iters: int) -> None:
    """Train each run not finished yet, one after another (a run with a checkpoint resumes it), with a line per run
    saying which of how many it was, the time so far and the estimated time left."""
    todo = [r for r in runs if not finished(r)]
    if len(todo) < len(runs):
        print(f"{len(runs) - len(todo)} of {len(runs)} runs already finished: not run again", flush=True)
    t0, spent, expected = time.perf_counter(), 0.0, 0.0
    for i, run in enumerate(todo, 1):
        start = time.perf_counter()
        args = run.args + [f"--out_dir={run.dir}"] + ["--init_from=resume"] * (run.dir / "ckpt.pt").exists()
        print(f"$ python train.py {' '.join(args)}", flush=True)
        if subprocess.run([sys.executable, str(Path(__file__).with_name("train.py")), *args]).returncode:
            raise UserError(f"the training run into {run.dir} failed: see its output above")
        spent, expected = spent + time.perf_counter() - start, expected + estimate(run, timings, eval_iters)
        left = spent / expected * sum(estimate(r, timings, eval_iters) for r in todo[i:])
        print(f"[{i}/{len(todo)}] {run.dir.name} done in {time.perf_counter() - start:.0f} s; "
              f"{clock(time.perf_counter() - t0)} so far, about {clock(left)} left", flush=True)


def clock(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
