"""The runs of an attention-variant sweep (compare.py): every variant, size, seed and MHA -> GQA/MQA conversion as
the train.py command that makes it, what each is estimated to cost, and launching them one after another with
progress, stopping cleanly on SIGTERM/SIGINT. A run's tags carry what the report needs to group it (variant, seed,
size, match, conversion).
"""

import ctypes
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from model import GPT, GPTConfig
from smallgpt.checkpoint import Source, load_checkpoint, run_config
from smallgpt.configs import VARIANT, CompareConfig, TrainConfig, size_of
from smallgpt.errors import UserError
from smallgpt.measure import default_kv_heads
from smallgpt.runlog import read_run, unfinished

STARTUP_S = 6.0  # a train.py process's start (imports, data, model) and end, in the plan's estimate
PR_SET_PDEATHSIG = 1  # linux/prctl.h


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
        return m.n_layer, m.n_embd, m.n_head, m.n_kv_head, m.mlp_hidden, m.kv_lora_rank


def variant_name(config: GPTConfig) -> str:
    """'mha', 'gqa<n_kv_head>', 'mqa' or 'mla<kv_lora_rank>', then its window_suffix ('mha-sssl64')."""
    name = (
        kv_heads_name(config.n_kv_head, config.n_head)
        if config.kv_lora_rank is None
        else f"mla{config.kv_lora_rank}"
    )
    return name + window_suffix(config)


def window_suffix(config: GPTConfig | TrainConfig) -> str:
    """'-<window_pattern><window>' where layers are local ('-sssl64'), '' where none is."""
    return f"-{config.window_pattern.lower()}{config.window}" if config.window is not None else ""


def kv_heads_name(n_kv_head: int, n_head: int) -> str:
    """'mha' (n_kv_head = n_head), 'mqa' (1) or 'gqa<n_kv_head>', as GPTConfig.attention_kind tells them apart."""
    return "mha" if n_kv_head == n_head else "mqa" if n_kv_head == 1 else f"gqa{n_kv_head}"


def variant_config(mha: GPTConfig, name: str) -> GPTConfig:
    """The variant configs.VARIANT names of an all-global MHA model (a ValueError if it cannot be one at this
    shape)."""
    parts = VARIANT.fullmatch(name)
    assert parts is not None, name  # CompareConfig refused any other name
    if parts["pattern"]:
        pattern = parts["pattern"].upper()  # train.py's window_pattern is upper case
        mha = dataclasses.replace(mha, window=int(parts["window"]), window_pattern=pattern)
    if parts["kv_lora_rank"]:
        return dataclasses.replace(mha, kv_lora_rank=int(parts["kv_lora_rank"]))
    n_kv_head = {"mha": mha.n_head, "mqa": 1}.get(parts["kind"]) or int(parts["n_kv_head"])
    return dataclasses.replace(mha, n_kv_head=n_kv_head)


def variant_names(cfg: CompareConfig, n_head: int) -> list[str]:
    """The sweep's variants by name: --variants, or those of --kv_heads (default: measure.default_kv_heads)."""
    if cfg.variants:
        return cfg.variants
    return [kv_heads_name(g, n_head) for g in cfg.kv_heads or default_kv_heads(n_head)]


def variant_flags(model: GPTConfig) -> list[str]:
    """train.py's flags that make a run's model this variant."""
    latent = [f"--kv_lora_rank={model.kv_lora_rank}"] if model.kv_lora_rank is not None else []
    local = (
        [f"--window={model.window}", f"--window_pattern={model.window_pattern}"]
        if model.window
        else []
    )
    return [f"--n_kv_head={model.n_kv_head}", *latent, *local]


def sizes(size_list: list, base: TrainConfig) -> list[tuple[str, TrainConfig]]:
    """(label, the base run at that size) for each of --sizes (checked by size_of); none given: the base run's own
    size."""
    out = []
    for n_layer, n_embd in map(size_of, size_list) if size_list else [(base.n_layer, base.n_embd)]:
        try:
            out.append(
                (f"{n_layer}x{n_embd}", dataclasses.replace(base, n_layer=n_layer, n_embd=n_embd))
            )
        except ValueError as e:
            raise UserError(f"sizes: {n_layer}x{n_embd}: {e}") from e
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
        raise UserError(
            f"match=params: no MLP width gives {variant_name(config)} at {config.n_layer}x{config.n_embd} "
            f"MHA's {target:,} parameters within 1% (nearest: mlp_hidden={max(hidden, 1)}, "
            f"{count(max(hidden, 1)):,}); use --match=width"
        )
    return hidden


def evaluations(iters: int, interval: int, at_start: bool) -> int:
    """How many evaluations train.py logs in a run of iters iterations."""
    return len(set(range(0 if at_start else interval, iters + 1, interval)) | {iters})


def plan(cfg: CompareConfig, base: TrainConfig, vocab_size: int, root: Path) -> list[Run]:
    """Every run of the sweep, in the order it trains: per size and seed, the scratch variants (MHA first), then
    the conversions of that seed's MHA model. cfg: compare.py's CompareConfig; base: train.py's TrainConfig."""
    return [
        run
        for label, sbase in sizes(cfg.sizes, base)
        for seed in range(base.seed, base.seed + cfg.seeds)
        for run in seed_runs(cfg, sbase, label if cfg.sizes else None, seed, vocab_size, root)
    ]


def seed_runs(
    cfg: CompareConfig, base: TrainConfig, label: str | None, seed: int, vocab_size: int, root: Path
) -> list[Run]:
    """One seed's runs of base (at a size of --sizes named label, or at its own)."""
    mha = dataclasses.replace(base.model_config(vocab_size), n_kv_head=base.n_head)
    size = f"{base.n_layer}x{base.n_embd}"
    common = (
        cfg.train_args
        + [f"--n_layer={base.n_layer}", f"--n_embd={base.n_embd}"] * (label is not None)
        + [f"--seed={seed}", f"--wandb_group={base.wandb_group or root.name}"]
    )

    def run(
        name: str, model: GPTConfig, args: list[str], tags: list[str], iters: int, evals: int
    ) -> Run:
        tags = [name, f"seed={seed}", f"size={size}", f"n_kv_head={model.n_kv_head}", *tags]
        return Run(
            name,
            seed,
            size,
            root / f"{label + '-' if label else ''}{name}-s{seed}",
            model,
            common + [*variant_flags(model), f"--wandb_tags={','.join(tags)}", *args],
            iters,
            evals,
            base.gradient_accumulation_steps * base.batch_size * base.block_size,
        )

    runs, evals = [], evaluations(base.max_iters, base.eval_interval, base.eval_at_start)
    names = variant_names(cfg, base.n_head)
    for name in names:
        for match in cfg.match if name != "mha" else ["width"]:
            model = variant_config(mha, name)
            if match == "params":
                model = dataclasses.replace(model, mlp_hidden=matched_mlp_hidden(mha, model))
            runs.append(
                run(
                    variant_name(model) + "-params" * (match == "params"),
                    model,
                    [f"--mlp_hidden={model.mlp_hidden}"] * (match == "params"),
                    [f"match={match}"],
                    base.max_iters,
                    evals,
                )
            )
    for name in (
        name for name in names if cfg.convert and name != "mha" and "-" not in name
    ):  # local: scratch
        source, target = next(r for r in runs if r.name == "mha"), variant_config(mha, name)
        # MLA's K/V come from one SVD of MHA's, with no latent norm (convert.to_latent); the methods pool K/V heads
        latent = target.kv_lora_rank is not None
        target = dataclasses.replace(target, latent_norm=not latent)
        for method in ["svd"] if latent else cfg.convert_methods:
            how = ["--latent_norm=False"] if latent else [f"--convert_method={method}"]
            for fraction in cfg.uptrain_fractions:
                iters = round(fraction * base.max_iters)
                runs.append(
                    run(
                        f"mha-to-{variant_name(target)}-{method}-u{fraction:g}",
                        target,
                        [
                            f"--init_from={Source('convert', str(source.dir))}",
                            *how,
                            *uptraining(base, iters, cfg.uptrain_lr_scale),
                        ],
                        ["match=width", "converted", f"convert={method}", f"uptrain={fraction:g}"],
                        iters,
                        1 if iters == 0 else 2,
                    )
                )
    return runs


def uptraining(base: TrainConfig, iters: int, lr_scale: float) -> list[str]:
    """train.py's schedule for uptraining a converted model for iters iterations (0: evaluate it only): its own
    linear warm-up over a tenth of them (at the peak learning rate at once, the converted model's loss first rises),
    peak learning rates lr_scale times the base run's, cosine decay; evaluated at the start and the end."""
    if iters == 0:
        return ["--eval_only=True", "--max_iters=0"]
    return [
        f"--max_iters={iters}",
        f"--lr_decay_iters={iters}",
        f"--warmup_iters={max(1, iters // 10)}",
        f"--learning_rate={base.learning_rate * lr_scale:g}",
        f"--muon_lr={base.muon_lr * lr_scale:g}",
        f"--min_lr={base.min_lr * lr_scale:g}",
        f"--eval_interval={iters}",
        "--eval_at_start=True",
        "--always_save_checkpoint=True",
    ]


def finished(run: Run) -> bool:
    """Whether run's log holds its final evaluation, whole (runlog.unfinished), and, for a run that trains, it has a
    checkpoint."""
    if not (run.dir / "log.jsonl").is_file() or (run.iters and not (run.dir / "ckpt.pt").is_file()):
        return False
    try:
        return unfinished(read_run(run.dir), run.iters) is None
    except (UserError, KeyError):
        return False


def trained(run: Run) -> dict | None:
    """What the checkpoint in run's folder was trained as: {'iter_num', 'config' (its run's),
    'data_meta' (the dataset's it read)}; None where the folder holds no checkpoint."""
    path = run.dir / "ckpt.pt"
    if not path.is_file():
        return None
    ckpt = load_checkpoint(path, "cpu", mmap=True)
    config = run_config(ckpt)
    return {"iter_num": ckpt["iter_num"], "config": config, "data_meta": ckpt.get("data_meta")}


def train_args(run: Run) -> list[str]:
    """train.py's arguments for a run not finished: from the start, or resuming its checkpoint; one already at the
    run's last iteration (its final evaluation lost to a kill mid-write) is evaluated again, as resuming it would
    train, evaluate and log nothing."""
    args = run.args + [f"--out_dir={run.dir}"]
    ckpt = run.dir / "ckpt.pt"
    if not ckpt.exists():
        return args
    done = run.iters and load_checkpoint(ckpt, "cpu", mmap=True)["iter_num"] >= run.iters
    return args + ["--init_from=resume"] + ["--eval_only=True"] * bool(done)


def estimated_seconds(
    run: Run, timings: dict[tuple, tuple[float, float]], eval_iters: int
) -> float:
    """Seconds run is expected to take, from its shape's timed training step and evaluation batch."""
    step_s, eval_s = timings[run.shape]
    return STARTUP_S + run.iters * step_s + run.evals * 2 * eval_iters * eval_s


def launch_all(
    runs: list[Run], timings: dict[tuple, tuple[float, float]], eval_iters: int, stop: "Stop"
) -> None:
    """Train each run not finished yet, one after another (a run with a checkpoint resumes it), with a line per run
    saying which of how many it was, the time so far and the estimated time left; stop: the sweep's signal handling."""
    todo = [r for r in runs if not finished(r)]
    if len(todo) < len(runs):
        print(
            f"{len(runs) - len(todo)} of {len(runs)} runs already finished: not run again",
            flush=True,
        )
    t0, spent, expected = time.perf_counter(), 0.0, 0.0
    for i, run in enumerate(todo, 1):
        start = time.perf_counter()
        args = train_args(run)
        print(f"$ python train.py {' '.join(args)}", flush=True)
        stop.where = f"in {run.dir} (run {i} of the {len(todo)} left)"
        if stop.wait(
            [sys.executable, str(Path(__file__).resolve().parent.parent / "train.py"), *args]
        ):
            raise UserError(f"the training run into {run.dir} failed: see its output above")
        stop.where = "between runs"
        spent, expected = (
            spent + time.perf_counter() - start,
            expected + estimated_seconds(run, timings, eval_iters),
        )
        left = spent / expected * sum(estimated_seconds(r, timings, eval_iters) for r in todo[i:])
        print(
            f"[{i}/{len(todo)}] {run.dir.name} done in {time.perf_counter() - start:.0f} s; "
            f"{clock(time.perf_counter() - t0)} so far, about {clock(left)} left",
            flush=True,
        )


def clock(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


class Stopped(Exception):
    """The sweep stopped on SIGTERM or SIGINT (its train.py child, if one ran, saved and ended first)."""

    def __init__(self, signum: int, where: str) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} {where}")
        self.signum = signum


class Stop:
    """A sweep's SIGTERM and SIGINT, for a with block: forwarded to the train.py child it waits for (which finishes
    its step, saves and exits), then Stopped; with no child running, Stopped at once. where: what the sweep is doing,
    for Stopped's message."""

    def __init__(self) -> None:
        self.child: subprocess.Popen | None = None
        self.signum: int | None = None
        self.where = "before the first run"
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> "Stop":
        self.previous = {
            sig: signal.signal(sig, self.handle) for sig in (signal.SIGTERM, signal.SIGINT)
        }
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def handle(self, signum: int, _frame: FrameType | None) -> None:
        self.signum = self.signum or signum
        if self.child is None:
            raise Stopped(signum, self.where)
        self.child.send_signal(signum)

    def wait(self, command: list[str]) -> int:
        """Run command to its end and return its exit status; Stopped if a signal came meanwhile."""
        self.child = subprocess.Popen(command, preexec_fn=die_with_parent())
        try:
            code = self.child.wait()
        finally:
            self.child = None
        if self.signum is not None:
            raise Stopped(self.signum, self.where)
        return code


def die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn after which Linux sends the child SIGTERM (train.py then saves and exits) when this process dies,
    kill -9 included (prctl PR_SET_PDEATHSIG); None on other systems."""
    if not sys.platform.startswith("linux"):
        return None
    prctl, parent = ctypes.CDLL(None, use_errno=True).prctl, os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
        if os.getppid() != parent:  # the parent died before prctl took effect: no signal would come
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec
