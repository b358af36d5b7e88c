"""The runs of an attention-variant sweep (compare.py): every variant, size, seed, learning rate and
MHA -> GQA/MQA conversion as the train.py command that makes it, what each is estimated to cost,
and launching them one after another with progress, stopping cleanly on SIGTERM/SIGINT. A run's
tags carry what the report needs to group it (variant, seed, size, match, learning rate,
conversion).
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

from model import GPT, IMPORTED_KINDS, LAYER_KINDS, GPTConfig
from smallgpt.checkpoint import Source, load_checkpoint, run_config
from smallgpt.configs import CompareConfig, TrainConfig, rate_label, size_of
from smallgpt.convert import CONVERT_METHODS
from smallgpt.errors import UserError
from smallgpt.measure import default_kv_heads
from smallgpt.runlog import read_run, unfinished
from smallgpt.variant import MHA, OPTIONS, Variant

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
    rate: str | None = None  # its learning rate of --lrs (configs.rate_label); None: the base's

    @property
    def shape(self) -> tuple[int, ...]:
        m = self.model
        return m.n_layer, m.n_embd, m.n_head, m.n_kv_head, m.mlp_hidden, m.kv_lora_rank


def mha_config(base: TrainConfig, vocab_size: int) -> GPTConfig:
    """The base run's model as MHA (all global), which every variant is made of."""
    return dataclasses.replace(base.model_config(vocab_size), n_kv_head=base.n_head)


def compared_variants(cfg: CompareConfig, mha: GPTConfig) -> list[Variant]:
    """The sweep's variants: --variants, or those of --kv_heads (measure.default_kv_heads where
    none is given), each named as what it makes of mha; a ValueError for K/V heads mha cannot
    have."""

    if cfg.variants:
        return [Variant.parse(name) for name in cfg.variants]
    kv_heads = cfg.kv_heads or default_kv_heads(mha.n_head)
    return [Variant.from_config(dataclasses.replace(mha, n_kv_head=g)) for g in kv_heads]


def variant_flags(model: GPTConfig) -> list[str]:
    """train.py's flags that make a run's model this variant: its K/V heads, MLA's latent, and
    every key of variant.OPTIONS away from its default."""
    flags = [f"--n_kv_head={model.n_kv_head}"]
    if model.kv_lora_rank is not None:
        flags.append(f"--kv_lora_rank={model.kv_lora_rank}")
    defaults = GPTConfig.__dataclass_fields__
    for key in OPTIONS:
        value = getattr(model, key)
        if value != defaults[key].default:
            flags.append(f"--{key}={value}")
    return flags


def sizes(size_list: list, base: TrainConfig) -> list[tuple[str, TrainConfig]]:
    """(label, the base run at that size) for each of --sizes (checked by size_of); none given: the
    base run's own size."""
    pairs = [size_of(size) for size in size_list] or [(base.n_layer, base.n_embd)]
    out = []
    for n_layer, n_embd in pairs:
        try:
            sized = dataclasses.replace(base, n_layer=n_layer, n_embd=n_embd)
        except ValueError as e:
            raise UserError(f"sizes: {n_layer}x{n_embd}: {e}") from e
        out.append((f"{n_layer}x{n_embd}", sized))
    return out


def matched_mlp_hidden(reference: GPTConfig, config: GPTConfig) -> int:
    """The MLP width that gives config as many parameters as reference, within 1% (the MQA paper's
    compensation, https://arxiv.org/abs/1911.02150 s3: a wider feed-forward layer)."""

    def count(hidden: int) -> int:
        with torch.device("meta"):
            return GPT(dataclasses.replace(config, mlp_hidden=hidden)).num_params()

    with torch.device("meta"):
        target = GPT(reference).num_params()
    h0 = config.mlp_hidden
    hidden = h0 + round((target - count(h0)) / (count(h0 + 1) - count(h0)))
    if hidden < 1 or abs(count(hidden) - target) > 0.01 * target:
        nearest = max(hidden, 1)
        raise UserError(
            f"match=params: no MLP width gives {Variant.from_config(config)} at "
            f"{config.n_layer}x{config.n_embd} MHA's {target:,} parameters within 1% (nearest: "
            f"mlp_hidden={nearest}, {count(nearest):,}); use --match=width"
        )
    return hidden


def evaluations(iters: int, interval: int, at_start: bool) -> int:
    """How many evaluations train.py logs in a run of iters iterations."""
    return len(set(range(0 if at_start else interval, iters + 1, interval)) | {iters})


def plan(cfg: CompareConfig, base: TrainConfig, vocab_size: int, root: Path) -> list[Run]:
    """Every run of the sweep, in the order it trains: per size and seed, the scratch variants (MHA
    first), then the conversions of that seed's MHA model. cfg: compare.py's CompareConfig; base:
    train.py's TrainConfig."""
    return [
        run
        for label, sbase in sizes(cfg.sizes, base)
        for seed in range(base.seed, base.seed + cfg.seeds)
        for run in seed_runs(cfg, sbase, label if cfg.sizes else None, seed, vocab_size, root)
    ]


@dataclass(slots=True)
class SeedRuns:
    """What one seed's runs at one size share: where their folders go, the seed and size their
    tags name, and the train.py arguments they all take."""

    root: Path
    label: str | None  # the size's label in --sizes, which prefixes the folders; None: base's own
    seed: int
    size: str  # '<n_layer>x<n_embd>'
    common: list[str]  # train.py's arguments for each of the runs
    tokens_per_iter: int

    def run(
        self,
        name: str,
        model: GPTConfig,
        args: list[str],
        tags: list[str],
        iters: int,
        evals: int,
        rate: "Rate | None" = None,
    ) -> Run:
        """The run called name, of model, with its own train.py arguments and tags (at rate, one of
        --lrs, if given)."""
        tags = [
            name,
            f"seed={self.seed}",
            f"size={self.size}",
            f"n_kv_head={model.n_kv_head}",
            *tags,
        ]
        prefix = f"{self.label}-" if self.label else ""
        at = ""
        if rate is not None:
            tags.append(f"lr={rate.label}")
            args = [*rate.flags, *args]
            at = f"-{rate.folder}"
        folder = self.root / f"{prefix}{name}{at}-s{self.seed}"
        own = [*variant_flags(model), f"--wandb_tags={','.join(tags)}", *args]
        return Run(
            name,
            self.seed,
            self.size,
            folder,
            model,
            self.common + own,
            iters,
            evals,
            self.tokens_per_iter,
            rate and rate.label,
        )


@dataclass(frozen=True, slots=True)
class Rate:
    """One learning rate of --lrs: what names it and train.py's flags for it."""

    label: str  # configs.rate_label: '0.003', or '0.003/0.02' with a Muon rate given apart
    folder: str  # in its runs' folders: 'lr0.003', 'lr0.003-mlr0.02'
    flags: list[str]


def rates(cfg: CompareConfig, base: TrainConfig) -> list[Rate | None]:
    """The sweep's learning rates (None: the base run's alone): AdamW's peak rate, min_lr in the
    base run's proportion to it and, with Muon, Muon's rate (given apart, or the base muon_lr scaled
    as AdamW's)."""
    out = []
    for lr, muon_lr in cfg.rates():
        scale = lr / base.learning_rate
        flags = [f"--learning_rate={lr:g}", f"--min_lr={base.min_lr * scale:g}"]
        if base.optimizer == "muon":
            flags.append(f"--muon_lr={base.muon_lr * scale if muon_lr is None else muon_lr:g}")
        folder = f"lr{lr:g}" + ("" if muon_lr is None else f"-mlr{muon_lr:g}")
        out.append(Rate(rate_label(lr, muon_lr), folder, flags))
    return out or [None]


def seed_runs(
    cfg: CompareConfig, base: TrainConfig, label: str | None, seed: int, vocab_size: int, root: Path
) -> list[Run]:
    """One seed's runs of base (at a size of --sizes named label, or at its own)."""
    mha = mha_config(base, vocab_size)
    variants = compared_variants(cfg, mha)
    # the train.py arguments every run of this seed takes
    common = list(cfg.train_args)
    if label is not None:
        common += [f"--n_layer={base.n_layer}", f"--n_embd={base.n_embd}"]
    common += [f"--seed={seed}", f"--wandb_group={base.wandb_group or root.name}"]
    tokens_per_iter = base.gradient_accumulation_steps * base.batch_size * base.block_size
    at_seed = SeedRuns(root, label, seed, f"{base.n_layer}x{base.n_embd}", common, tokens_per_iter)
    # the variants from scratch, then the conversions of this seed's MHA model
    runs = [
        run
        for rate in rates(cfg, base)
        for run in scratch_runs(cfg, base, at_seed, mha, variants, rate)
    ]
    if cfg.convert:
        runs += conversion_runs(cfg, base, at_seed, mha, variants, runs)
    return runs


def scratch_runs(
    cfg: CompareConfig,
    base: TrainConfig,
    at_seed: SeedRuns,
    mha: GPTConfig,
    variants: list[Variant],
    rate: Rate | None = None,
) -> list[Run]:
    """Each variant trained from scratch, at each of --match (MHA at its own width only), at rate
    (one of --lrs; None: the base run's)."""
    evals = evaluations(base.max_iters, base.eval_interval, base.eval_at_start)
    runs = []
    for variant in variants:
        matches = cfg.match if variant != MHA else ["width"]
        for match in matches:
            model = variant.config(mha)
            name = str(Variant.from_config(model))
            args = []
            if match == "params":
                model = dataclasses.replace(model, mlp_hidden=matched_mlp_hidden(mha, model))
                name += "-params"
                args.append(f"--mlp_hidden={model.mlp_hidden}")
            tags = [f"match={match}"]
            runs.append(at_seed.run(name, model, args, tags, base.max_iters, evals, rate))
    return runs


def conversion_runs(
    cfg: CompareConfig,
    base: TrainConfig,
    at_seed: SeedRuns,
    mha: GPTConfig,
    variants: list[Variant],
    scratch: list[Run],
) -> list[Run]:
    """The seed's MHA model (of scratch) converted to each variant converted_from_mha, by each
    method, uptrained for each fraction (a variant with local layers, or Qwen3.5's attention
    options, is trained from scratch only)."""
    runs = []
    for variant in [v for v in variants if converted_from_mha(v)]:
        source = next(r for r in scratch if r.name == "mha")
        # MLA's K/V come from one SVD of MHA's, with no latent norm (convert.to_latent); the
        # methods pool K/V heads (a hybrid's attention layers too; an MHA hybrid's are copied)
        latent = variant.attention == "mla"
        target = dataclasses.replace(variant.config(mha), latent_norm=not latent)
        methods = ["svd"] if latent else cfg.convert_methods
        if variant.attention == "mha":
            methods = ["copy"]
        for method in methods:
            how = [f"--convert_method={method}"] if method in CONVERT_METHODS else []
            if latent:
                how = ["--latent_norm=False"]
            for fraction in cfg.uptrain_fractions:
                iters = round(fraction * base.max_iters)
                name = f"mha-to-{Variant.from_config(target)}-{method}-u{fraction:g}"
                # the conversion's keys where they are read: the teacher's by a run that
                # distils (one uptrained for 0 iterations is the conversion alone), the hybrid's
                # by a conversion into a hybrid
                distills = cfg.uptrain_distill and iters > 0
                steer = [
                    a
                    for a in cfg.conversion_args
                    if (distills or not is_teacher_key(a))
                    and (target.recurrent_layers or is_teacher_key(a))
                ]
                if distills:
                    name += "-kl"  # uptrained on the KL to the MHA model
                    steer = [f"--distill={cfg.uptrain_distill}", *steer]
                args = [
                    f"--init_from={Source('convert', str(source.dir))}",
                    *how,
                    *steer,
                    *uptraining(base, iters, cfg.uptrain_lr_scale),
                ]
                tags = ["match=width", "converted", f"convert={method}", f"uptrain={fraction:g}"]
                evals = 1 if iters == 0 else 2
                runs.append(at_seed.run(name, target, args, tags, iters, evals))
    return runs


def is_teacher_key(arg: str) -> bool:
    """Whether a train.py flag steers a distillation's teacher (read only by a run that distils)."""
    return arg.split("=", 1)[0] in ("--teacher", "--distill_ce")


def check_kinds_imported(config: GPTConfig, where: str) -> None:
    """A UserError, naming where, when a layer of config is of a kind registered in this process
    alone (register_kind), not by importing model.py: a run of it in a process of its own would
    fail there, after whatever ran before it."""
    letters = getattr(config, config.pattern_key) + config.layer_letters
    added = [
        LAYER_KINDS[letter]
        for letter in dict.fromkeys(letters)
        if IMPORTED_KINDS.get(letter) is not LAYER_KINDS[letter]
    ]
    if added:
        kinds = ", ".join(f"{kind.letter!r} ({kind.name})" for kind in added)
        raise UserError(
            f"{where}: layer kind {kinds} is registered in this process only (register_kind), "
            "and train.py runs in a process of its own, where it is not registered: define it "
            "in a module that model.py imports, as a row of model.LAYER_KINDS (docs/"
            'architecture.md "Adding a kind of layer")'
        )


def converted_from_mha(variant: Variant) -> bool:
    """Whether --convert makes this variant of the MHA model: all-global attention (K/V heads
    pooled, or MLA by SVD), or a hybrid of global attention and a kind that converts attention
    (layer_pattern its only change; smallgpt/hybridize.py)."""
    if variant == MHA:
        return False
    if not variant.suffix:
        return True
    letters = variant.kinds_only
    if letters is None or variant.attention == "mla":
        return False
    kinds = [LAYER_KINDS[x] for x in letters]
    return all(kind.conversion_source or kind.converts_attention for kind in kinds)


def uptraining(base: TrainConfig, iters: int, lr_scale: float) -> list[str]:
    """train.py's schedule for uptraining a converted model for iters iterations (0: evaluate it
    only): its own linear warm-up over a tenth of them (at the peak learning rate at once, the
    converted model's loss first rises), peak learning rates lr_scale times the base run's, cosine
    decay; evaluated at the start and the end."""
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
    """Whether run's log holds its final evaluation, whole (runlog.unfinished), and, for a run that
    trains, it has a checkpoint; or, for a run at a rate of --lrs, it diverged."""
    if not (run.dir / "log.jsonl").is_file():
        return False
    # only a run at a rate of --lrs may have diverged, before any checkpoint
    if run.rate is None and run.iters and not (run.dir / "ckpt.pt").is_file():
        return False
    try:
        logged = read_run(run.dir)
    except (UserError, KeyError):
        return False
    if run.rate is not None and logged["diverged"] and not logged["torn"]:
        return True
    if run.iters and not (run.dir / "ckpt.pt").is_file():
        return False
    return unfinished(logged, run.iters) is None


def trained(run: Run) -> dict | None:
    """What the checkpoint in run's folder was trained as: {'iter_num', 'config' (its run's),
    'model_config' (its model's), 'data_meta' (the dataset's it read)}; None where the folder holds
    no checkpoint."""
    path = run.dir / "ckpt.pt"
    if not path.is_file():
        return None
    ckpt = load_checkpoint(path, "cpu", mmap=True)
    return {
        "iter_num": ckpt["iter_num"],
        "config": run_config(ckpt),
        "model_config": ckpt["model_config"],
        "data_meta": ckpt.get("data_meta"),
    }


def train_args(run: Run) -> list[str]:
    """train.py's arguments for a run not finished: from the start, or resuming its checkpoint; one
    already at the run's last iteration (its final evaluation lost to a kill mid-write) is evaluated
    again, as resuming it would train, evaluate and log nothing."""
    args = run.args + [f"--out_dir={run.dir}"]
    ckpt = run.dir / "ckpt.pt"
    if not ckpt.exists():
        return args
    done = run.iters and load_checkpoint(ckpt, "cpu", mmap=True)["iter_num"] >= run.iters
    args.append("--init_from=resume")
    if done:
        args.append("--eval_only=True")
    return args


def estimated_seconds(
    run: Run, timings: dict[tuple, tuple[float, float]], eval_iters: int
) -> float:
    """Seconds run is expected to take, from its shape's timed training step and evaluation
    batch."""
    step_s, eval_s = timings[run.shape]
    return STARTUP_S + run.iters * step_s + run.evals * 2 * eval_iters * eval_s


def launch_all(
    runs: list[Run], timings: dict[tuple, tuple[float, float]], eval_iters: int, stop: "Stop"
) -> None:
    """Train each run not finished yet, one after another (a run with a checkpoint resumes it), with
    a line per run saying which of how many it was, the time so far and the estimated time left;
    stop: the sweep's signal handling."""
    todo = [r for r in runs if not finished(r)]
    if len(todo) < len(runs):
        print(
            f"{len(runs) - len(todo)} of {len(runs)} runs already finished: not run again",
            flush=True,
        )
    train_py = Path(__file__).resolve().parent.parent / "train.py"
    t0 = time.perf_counter()
    spent = 0.0  # seconds the runs so far took
    expected = 0.0  # ... and their estimate
    for i, run in enumerate(todo, 1):
        start = time.perf_counter()
        args = train_args(run)
        print(f"$ python train.py {' '.join(args)}", flush=True)
        stop.where = f"in {run.dir} (run {i} of the {len(todo)} left)"
        if stop.wait([sys.executable, str(train_py), *args]):
            if not finished(run):  # a run at a rate of --lrs may diverge: its rate then loses
                raise UserError(f"the training run into {run.dir} failed: see its output above")
            print(
                f"{run.dir.name} diverged at rate {run.rate}: the report counts it so (a rate at "
                "which a seed diverged is never a variant's chosen one); the sweep goes on",
                flush=True,
            )
        stop.where = "between runs"
        # the time left: the runs left's estimate, scaled by how the estimate has fared so far
        spent += time.perf_counter() - start
        expected += estimated_seconds(run, timings, eval_iters)
        left = spent / expected * sum(estimated_seconds(r, timings, eval_iters) for r in todo[i:])
        print(
            f"[{i}/{len(todo)}] {run.dir.name} done in {time.perf_counter() - start:.0f} s; "
            f"{clock(time.perf_counter() - t0)} so far, about {clock(left)} left",
            flush=True,
        )


def clock(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


class Stopped(Exception):
    """The sweep stopped on SIGTERM or SIGINT (its train.py child, if one ran, saved and ended
    first)."""

    def __init__(self, signum: int, where: str) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} {where}")
        self.signum = signum


class Stop:
    """A sweep's SIGTERM and SIGINT, for a with block: forwarded to the train.py child it waits for
    (which finishes its step, saves and exits), then Stopped; with no child running, Stopped at
    once. where: what the sweep is doing, for Stopped's message."""

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
    """A preexec_fn after which Linux sends the child SIGTERM (train.py then saves and exits) when
    this process dies, kill -9 included (prctl PR_SET_PDEATHSIG); None on other systems."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
        if os.getppid() != parent:  # the parent died before prctl took effect: no signal would come
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec
