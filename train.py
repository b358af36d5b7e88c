"""Train a GPT from a config file: `python train.py config/train_pycode_char.py --n_kv_head=2`.

Single process, or DDP / FSDP under torchrun (nccl on CUDA, gloo on CPU):
    torchrun --standalone --nproc_per_node=4 train.py config/train_gpt2.py [--parallel=fsdp]
"""

# configurator first: a Ctrl-C while torch imports is then one line, not a traceback
from configurator import UserError, build, checked_values, given_values, print_config, run_cli, with_fields_of

# isort: split
import math
import os
import signal
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch
import torch.distributed as dist

import checkpoint
import convert
import runtime
import sharding
from atomic import check_writes_into, folder_lock
from dataset import Batches, data_dir
from model import GPT, GPTConfig
from optim import lr_at, make_optimizer, state_bytes
from runlog import RunLog

RUN_FILES = ("ckpt.pt", "log.jsonl", "config.json")  # what a run writes into out_dir (and wandb/, ckpt-*.pt)
PRETRAINED_KEYS = ("dropout", "block_size", "n_kv_head")  # the model keys a run gives GPT-2's or a folder's weights


@with_fields_of(GPTConfig, block_size=256, n_layer=6, n_head=6, n_embd=384, bias=False, vocab_size=None)
@dataclass(slots=True)
class TrainConfig:
    """train.py's keys: the ones below, then every field of GPTConfig (the model) with its default there, except
    for the defaults given above (vocab_size None: the dataset's)."""

    # I/O
    out_dir: str = "out"
    eval_interval: int = 250
    log_interval: int = 10
    eval_iters: int = 50
    eval_only: bool = False
    eval_at_start: bool = True  # also evaluate before the first step (False saves that time in timed runs)
    always_save_checkpoint: bool = False  # False: save only when val loss improves
    keep_last: int = 0  # also keep the last K checkpoints as ckpt-<iteration>.pt (hard links: no extra disk)
    # 'scratch', 'resume' (from out_dir/ckpt.pt), 'auto' (resume if out_dir/ckpt.pt exists, else scratch: for
    # restarts, e.g. torchrun --max-restarts), 'convert:<ckpt or out_dir>' (another run's model with its K/V
    # heads made n_kv_head by convert_method: MHA -> GQA/MQA uptraining), OpenAI's GPT-2: 'gpt2', 'gpt2-medium',
    # 'gpt2-large', 'gpt2-xl', or 'hf:<local folder>' (GPT-2, or export.py's Starcoder2/GPTBigCode) (model keys other
    # than PRETRAINED_KEYS refused: the weights decide the model)
    init_from: str = "scratch"
    convert_method: str = "mean"  # each group's K/V head: the 'mean' of its heads, the 'first' of them, or 'random'
    # logging: wandb honours WANDB_MODE (online, offline, disabled); out_dir/log.jsonl is always written
    wandb_log: bool = False
    wandb_project: str = "smallgpt"
    wandb_run_name: str | None = None  # None: '<dataset>-<attention kind>'
    wandb_group: str | None = None
    wandb_tags: list[str] = field(default_factory=list)
    # data
    dataset: str = "pycode_char"  # a folder under data/, or a path to one
    gradient_accumulation_steps: int = 1  # in total over all DDP ranks
    batch_size: int = 12
    # AdamW and the learning-rate schedule (linear warm-up, cosine decay to min_lr)
    learning_rate: float = 1e-3
    max_iters: int = 5000
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # 0 disables clipping
    # 'adamw', or 'muon': Muon at muon_lr for the blocks' matrices, AdamW for the rest (docs/peers.md)
    optimizer: str = "adamw"
    muon_lr: float = 0.02
    # a NaN/inf loss: 'stop' (seen at log steps, no extra host sync; the last good checkpoint stays) or 'skip' (drop
    # every step whose gradient is not finite: one host sync per step)
    nonfinite: str = "stop"
    decay_lr: bool = True
    warmup_iters: int = 100
    lr_decay_iters: int = 5000
    min_lr: float = 1e-4
    # system
    device: str = "auto"  # 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'
    dtype: str = "auto"  # 'float32', 'bfloat16', 'float16' or 'auto': bf16 where it is faster (runtime.resolve_dtype)
    compile: bool = False
    # under torchrun, 'ddp' (each process holds all weights, gradients and AdamW moments) or 'fsdp' (each holds its
    # shard of them; a large model is built shard by shard: docs/training.md "FSDP")
    parallel: str = "ddp"
    seed: int = 1337
    peak_flops: float | None = None  # the device's peak FLOP/s for MFU; None: a GPU table or a CPU probe

    def __post_init__(self) -> None:
        positive = ["eval_interval", "log_interval", "eval_iters", "gradient_accumulation_steps", "batch_size",
                    "block_size"]
        problems = [f"{k}={getattr(self, k)} must be positive" for k in positive if getattr(self, k) < 1]
        problems += [f"{k}={getattr(self, k)} must not be negative" for k in ("max_iters", "warmup_iters",
                     "lr_decay_iters", "learning_rate", "min_lr", "weight_decay", "grad_clip", "keep_last")
                     if getattr(self, k) < 0]
        if self.nonfinite not in ("stop", "skip"):
            problems.append(f"nonfinite={self.nonfinite!r} must be 'stop' or 'skip'")
        try:
            source = checkpoint.parse_source(self.init_from)
        except ValueError as e:
            problems.append(str(e))
            source = checkpoint.Source("scratch")
        if self.convert_method not in (methods := convert.CONVERT_METHODS):
            problems.append(f"convert_method={self.convert_method!r} must be one of {', '.join(methods)}")
        if self.parallel not in ("ddp", "fsdp"):
            problems.append(f"parallel={self.parallel!r} must be 'ddp' or 'fsdp'")
        if self.optimizer not in ("adamw", "muon"):
            problems.append(f"optimizer={self.optimizer!r} must be 'adamw' or 'muon'")
        elif (self.optimizer, self.parallel) == ("muon", "fsdp"):
            problems.append("optimizer='muon' does not go with parallel='fsdp' (Muon orthogonalises whole matrices, "
                            "FSDP shards them): use optimizer='adamw', or parallel='ddp'")
        problems += [f"seed={self.seed} must not be negative"] * (self.seed < 0)
        if self.decay_lr and self.min_lr > self.learning_rate:
            problems.append(f"min_lr={self.min_lr} is above learning_rate={self.learning_rate}: the rate would rise "
                            f"as it decays")
        if self.decay_lr and self.lr_decay_iters < self.warmup_iters:
            problems.append(f"lr_decay_iters={self.lr_decay_iters} is below warmup_iters={self.warmup_iters}: the "
                            f"decay would end before the warm-up does")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            problems.append(f"dtype={self.dtype!r} must be one of auto, float32, bfloat16, float16")
        if problems:
            raise ValueError("invalid config: " + "; ".join(problems))
        if source.kind in ("scratch", "auto", "convert"):  # else the model is the weights'
            self.model_config(vocab_size=1)  # the model's own checks (n_head % n_kv_head, ...), before any work

    def model_config(self, vocab_size: int) -> GPTConfig:
        """The model these keys describe; vocab_size is the dataset's unless the config sets one."""
        keys = {f.name: getattr(self, f.name) for f in fields(GPTConfig)}
        return GPTConfig(**keys | {"vocab_size": self.vocab_size or vocab_size})


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Batches, eval_iters: int, amp: AbstractContextManager
             ) -> dict[str, float]:
    """Mean train and val loss over eval_iters fixed batches each."""
    model.eval()
    out = {}
    for split in ("train", "val"):
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            with amp:
                losses[k] = model(*batches.eval(split, k))[1].item()
        out[split] = losses.mean().item()
    model.train()
    return out


def init_model(cfg: TrainConfig, vocab_size: int, device: str, dtype: torch.dtype, ckpt: dict | None = None
               ) -> tuple[GPT, dict | None]:
    """The model to train, on device and sharded under FSDP: new, resumed from out_dir (the checkpoint is returned
    too), converted to n_kv_head, or GPT-2's."""
    fsdp = cfg.parallel == "fsdp"
    model, ckpt = load_model(cfg, vocab_size, ckpt)
    if model is None:  # new, or resumed under FSDP from a sharded checkpoint (its weights come with the optimizer's)
        mcfg = cfg.model_config(vocab_size) if ckpt is None else GPTConfig(**ckpt["model_config"])
        return sharding.build(mcfg, device, dtype, None if ckpt else cfg.seed, fsdp), ckpt
    return sharding.shard(model.to(device), device, dtype) if fsdp else model.to(device), ckpt


def load_model(cfg: TrainConfig, vocab_size: int, ckpt: dict | None = None) -> tuple[GPT | None, dict | None]:
    """init_model's model from weights (GPT-2's, or a checkpoint's), with the checkpoint when resuming; None for a
    new model, or one resumed under FSDP from a sharded checkpoint. ckpt: the checkpoint parse read, else read here."""
    source = checkpoint.parse_source(cfg.init_from).resolved(cfg.out_dir)
    existing = Path(cfg.out_dir) / "ckpt.pt"
    if source.kind != "resume" and existing.exists():  # a run's checkpoint is never replaced, nor its log mixed up
        raise UserError(f"{existing} holds another run: --init_from=resume (or auto) continues it; to start a new "
                        f"run, choose another out_dir or delete that one first")
    if source.kind == "scratch":
        return None, None
    if source.pretrained:
        model = checkpoint.load_run(source, tokenizer=False).model
        return convert.for_finetuning(model, str(source), vocab_size, cfg.dropout, cfg.block_size,
                                         cfg.n_kv_head), None
    resume = source.kind == "resume"
    path = source.checkpoint_path(cfg.out_dir)
    if ckpt is None:
        ckpt = checkpoint.load_checkpoint(path, "cpu", mmap=True)
    # resume: a model key given (parse took the others from the checkpoint) must be the model's or the run's (GPT-2
    # fine-tuned has GPT-2's shape whatever its config said); convert: all but n_kv_head must be the source's
    now = cfg if resume else cfg.model_config(vocab_size)
    run = checkpoint.run_config(ckpt) if resume else {}
    differ = [f"{k}: checkpoint {v!r}, config {getattr(now, k)!r}" for k, v in ckpt["model_config"].items()
              if hasattr(now, k) and getattr(now, k) not in (v, run.get(k, v)) and (resume or k != "n_kv_head")]
    if differ:
        where = cfg.out_dir if resume else source.where
        raise UserError(f"cannot {'resume' if resume else 'convert'} {where}: the config asks for another model "
                        f"({'; '.join(differ)}); drop those overrides{' or use a new out_dir' if resume else ''}")
    if resume and "sharded" in ckpt and cfg.parallel == "fsdp":
        return None, ckpt
    model = checkpoint.load_run(source, cfg.out_dir, tokenizer=False, ckpt=ckpt).model
    if resume:
        return model, ckpt
    return convert.convert_kv_heads(model, now.n_kv_head, cfg.convert_method, cfg.seed), None


def train_step(model: torch.nn.Module, raw_model: GPT, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
               batches: Batches, it: int, d: runtime.Dist, accum: int, amp: AbstractContextManager, grad_clip: float,
               skip_nonfinite: bool = False) -> tuple[torch.Tensor, bool]:
    """One optimizer step over this rank's accum micro-batches; returns their mean loss (a tensor: no host sync) and
    whether the step was taken: skip_nonfinite drops a step whose gradient norm is NaN/inf (the same on every rank,
    as gradients are all-reduced), at the cost of one host sync."""
    loss_sum = torch.zeros((), device=d.device)
    for micro in range(accum):
        x, y = batches.train(it, d.rank * accum + micro)
        with sharding.gradient_sync(model, raw_model, micro == accum - 1), amp:  # once a step
            _, loss = model(x, y)
        scaler.scale(loss / accum).backward()
        loss_sum += loss.detach() / accum
    taken = True
    if grad_clip > 0 or skip_nonfinite:
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), grad_clip if grad_clip > 0 else math.inf)
        taken = not skip_nonfinite or bool(torch.isfinite(sharding.whole(norm)))
    if taken:
        scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, taken


class Trainer:
    """One run, in the phases run() reads: set up (data, model, optimizer), restore a checkpoint, then steps with
    evaluation and checkpoints, progress logs, and a clean stop on a signal."""

    def __init__(self, cfg: TrainConfig, d: runtime.Dist, ckpt: dict | None = None) -> None:
        self.cfg, self.d, self.accum = cfg, d, cfg.gradient_accumulation_steps // d.world_size
        self.sharded = cfg.parallel == "fsdp"  # then every rank evaluates and saves (collectives), rank 0 writes
        if d.device_type == "cpu":
            runtime.keep_freed_memory()
        self.dtype, self.dtype_why = runtime.resolve_dtype(cfg.dtype, d.device_type, cfg.n_embd)
        self.amp = runtime.autocast(d.device_type, self.dtype)
        self.batches = Batches(data_dir(cfg.dataset), cfg.block_size, cfg.batch_size, cfg.seed, d.device)
        # pretrained weights (GPT-2's, a folder's) are fine-tuned on their own tokens only
        source = checkpoint.parse_source(cfg.init_from)
        checkpoint.check_pretrained_tokenizer(source, self.batches.meta, cfg.dataset)
        # raw_model: plain state_dict names, uncompiled, not wrapped by DDP (FSDP shards it in place)
        self.raw_model, ckpt = init_model(cfg, self.batches.meta["vocab_size"], d.device, self.dtype, ckpt)
        if source.pretrained:  # the run records the shape it trains
            self.cfg = cfg = replace(cfg, **asdict(self.raw_model.config))
        checkpoint.check_vocabulary(self.raw_model.config.vocab_size, self.batches.meta,
                                    ckpt and ckpt.get("data_meta"), cfg.dataset)

        self.optimizer = make_optimizer(self.raw_model, cfg.optimizer, cfg.weight_decay, cfg.learning_rate,
                                        (cfg.beta1, cfg.beta2), d.device, cfg.muon_lr)
        self.scaler = torch.amp.GradScaler(d.device_type, enabled=self.dtype == torch.float16)
        self.iter_num, self.best_val = 0, math.inf
        self.saved = None  # the iteration of the last good checkpoint
        runtime.seed_rank(cfg.seed, d.rank)  # dropout; weights and data draws have generators of their own
        if ckpt is not None:
            self.restore(ckpt)
        self.finished = ckpt is not None and self.iter_num >= cfg.max_iters and not cfg.eval_only  # resumed, done
        del ckpt
        self.model = torch.compile(self.raw_model) if cfg.compile else self.raw_model
        cuda_index = d.local_rank if d.device_type == "cuda" else None
        self.ddp_model = sharding.ddp(self.model, cuda_index) if d.world_size > 1 and not self.sharded else self.model
        self.log = self.start_log() if d.is_master and not self.finished else None
        self.tokens_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size
        self.peak = (cfg.peak_flops or runtime.peak_flops(d.device, self.dtype)) if d.is_master else None
        self.loss_sum, self.taken_steps, self.skipped = torch.zeros((), device=d.device), 0, 0
        self.t_start = self.t_last = time.perf_counter()
        self.last_log = self.iter_num

    def diverged(self, what: str, value: float) -> UserError:
        skip = "" if self.cfg.nonfinite == "skip" else ", or set --nonfinite=skip to drop such steps"
        kept = (f"the last good checkpoint (iteration {self.saved}) is kept" if self.saved is not None else
                "no checkpoint was written yet")
        return UserError(f"{what} is {value} at iteration {self.iter_num}: training diverged; {kept}; lower "
                         f"learning_rate (or raise warmup_iters){skip}")

    def restore(self, ckpt: dict) -> None:
        """Continue a checkpointed run: optimizer (and the weights, from a sharded checkpoint), grad scaler,
        iteration, best val loss, RNG states (dropout)."""
        sharding.load_optimizer(ckpt, Path(self.cfg.out_dir), self.raw_model, self.optimizer)
        if ckpt["scaler"]:  # empty when saved by a disabled scaler
            self.scaler.load_state_dict(ckpt["scaler"])
        self.iter_num, self.best_val, self.saved = ckpt["iter_num"], ckpt["best_val_loss"], ckpt["iter_num"]
        if "rng" in ckpt:
            runtime.set_rng_states(ckpt["rng"], self.d, self.cfg.seed)

    def start_log(self) -> RunLog:
        """Check out_dir, print the config and the model, and open the run log (rank 0 only)."""
        cfg, d, model_cfg = self.cfg, self.d, self.raw_model.config
        size = checkpoint.size_estimate(self.raw_model, state_bytes(self.optimizer), self.batches.meta)
        checkpoint.check_out_dir(Path(cfg.out_dir), size, cfg.keep_last)
        resumed = "; keys not given: the resumed run's" if self.iter_num else ""
        procs = f"{d.world_size} process{'es' if d.world_size > 1 else ''}"
        print(f"config ({procs}, {d.device}, {self.dtype}: {self.dtype_why}{resumed}):")
        print_config(cfg)
        log = RunLog(cfg, model_cfg, self.iter_num)  # iter_num > 0: resumed
        print(f"model: {self.raw_model.num_params() / 1e6:.2f}M parameters, {model_cfg.attention_kind} "
              f"(n_head={model_cfg.n_head}, n_kv_head={model_cfg.n_kv_head}), {model_cfg.pos_encoding} positions")
        return log

    def run(self) -> None:
        cfg = self.cfg
        if self.finished:  # e.g. --init_from=auto run again after the end
            if self.d.is_master:
                print(f"{Path(cfg.out_dir) / 'ckpt.pt'} is at iteration {self.iter_num}, max_iters={cfg.max_iters}: "
                      f"nothing to train (raise --max_iters to train on, or --eval_only=True to evaluate)")
            return
        signals: list[int] = []  # SIGTERM/SIGINT (pre-emption, Ctrl-C): finish the step, save, exit cleanly
        previous = {sig: signal.signal(sig, lambda signum, _: signals.append(signum))
                    for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            while True:
                lr = lr_at(self.iter_num, cfg.learning_rate, cfg.min_lr, cfg.warmup_iters, cfg.lr_decay_iters,
                           cfg.decay_lr)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr * group.get("lr_scale", 1.0)  # a checkpoint from before lr_scale has none
                at_eval = self.iter_num % cfg.eval_interval == 0 and (self.iter_num > 0 or cfg.eval_at_start)
                if at_eval or self.iter_num == cfg.max_iters or cfg.eval_only:
                    rng = runtime.rng_states(self.d)  # every rank's, as a resumed run starts here (a collective)
                    if self.d.is_master or self.sharded:
                        self.evaluate_and_save(lr, rng)
                if cfg.eval_only or self.iter_num >= cfg.max_iters:
                    break
                self.step()
                at_log = self.iter_num % cfg.log_interval == 0 or self.iter_num == cfg.max_iters
                if at_log:
                    self.log_progress(lr)
                if runtime.stop_requested(signals, self.d, at_log):
                    rng = runtime.rng_states(self.d)
                    if self.d.is_master:
                        why = signal.Signals(signals[0]).name if signals else "a signal to another rank"
                        print(f"stopping on {why} at iteration {self.iter_num}")
                    if self.d.is_master or self.sharded:
                        self.save(rng)
                    break
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self.log is not None:
                self.log.close()

    def step(self) -> None:
        cfg = self.cfg
        loss, taken = train_step(self.ddp_model, self.raw_model, self.optimizer, self.scaler, self.batches,
                                 self.iter_num, self.d, self.accum, self.amp, cfg.grad_clip, cfg.nonfinite == "skip")
        self.iter_num += 1
        if taken:
            self.loss_sum += loss
            self.taken_steps += 1
        else:
            self.skipped += 1

    def evaluate_and_save(self, lr: float, rng: list[dict]) -> None:
        """Evaluate, log, and save a checkpoint if val loss improved (or always_save_checkpoint)."""
        cfg = self.cfg
        losses = evaluate(self.model, self.batches, cfg.eval_iters, self.amp)
        if self.sharded:  # every rank evaluated the same batches; all decide as rank 0 does
            losses = sharding.from_rank0(losses)
        if not math.isfinite(losses["val"]):
            raise self.diverged("the val loss", losses["val"])
        if self.d.is_master:
            print(f"step {self.iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            self.log.write(event="eval", iter=self.iter_num, train_loss=losses["train"], val_loss=losses["val"], lr=lr,
                           elapsed_s=time.perf_counter() - self.t_start)
        improved = losses["val"] < self.best_val or cfg.always_save_checkpoint
        if self.iter_num not in (0, self.saved) and not cfg.eval_only and improved:  # saved: the resumed iteration
            self.best_val = min(self.best_val, losses["val"])
            self.save(rng)
        self.t_last = time.perf_counter()  # ms/iter leaves evaluation out

    def log_progress(self, lr: float) -> None:
        """The mean training loss since the last log step (all ranks), speed and MFU; a NaN/inf loss stops the run."""
        d = self.d
        if d.world_size > 1:  # a collective on every rank, only at log steps
            dist.all_reduce(self.loss_sum)
        steps = self.taken_steps
        train_loss = self.loss_sum.item() / d.world_size / steps if steps else math.nan  # host sync
        if steps and not math.isfinite(train_loss):
            raise self.diverged("the training loss", train_loss)
        now = time.perf_counter()
        dt = (now - self.t_last) / (self.iter_num - self.last_log)
        self.t_last, self.last_log, self.taken_steps = now, self.iter_num, 0
        self.loss_sum.zero_()
        if not d.is_master:
            return
        tok_s = self.tokens_per_iter / dt  # all processes together
        flops = self.raw_model.flops_per_token(self.cfg.block_size) * tok_s / d.world_size  # each one's FLOP/s
        if self.peak and flops > self.peak and not self.cfg.peak_flops and d.device_type == "cpu":
            # MFU over 100%: the CPU probe ran while something else had the cores. Probed again, the higher rate kept.
            self.peak = max(self.peak, runtime.peak_flops(d.device, self.dtype))
        mfu = flops / self.peak if self.peak else None
        print(f"iter {self.iter_num}: loss {train_loss:.4f}, lr {lr:.2e}, {dt * 1000:.1f} ms/iter, {tok_s:,.0f} tok/s"
              + (f", mfu {mfu:.1%}" if mfu is not None else "")
              + (f", {self.skipped} non-finite steps skipped so far" if self.skipped else ""))
        self.log.write(event="train", iter=self.iter_num, loss=train_loss, lr=lr, ms_per_iter=dt * 1000,
                       tokens_per_s=tok_s, mfu=mfu, skipped=self.skipped, elapsed_s=now - self.t_start)

    def save(self, rng: list[dict]) -> None:
        """Write out_dir/ckpt.pt (never with non-finite weights: the last good checkpoint stays) with every rank's
        generators (rng); under FSDP first the sharded checkpoint it names (weights and optimizer), and ckpt.pt holds
        the whole model gathered."""
        cfg, out, model = self.cfg, Path(self.cfg.out_dir), self.raw_model
        if not sharding.all_finite(model):
            raise self.diverged("a weight", math.nan)
        state = sharding.checkpoint_state(out, self.iter_num, model, self.optimizer)  # under FSDP, collectives
        if self.d.is_master:
            checkpoint.save_checkpoint(out / "ckpt.pt", model, keep_last=cfg.keep_last, scaler=self.scaler.state_dict(),
                                       iter_num=self.iter_num, best_val_loss=self.best_val, config=asdict(cfg),
                                       data_meta=self.batches.meta, rng=rng, **state)
            sharding.prune_sharded(out, self.iter_num)  # also those of an FSDP run resumed without FSDP
            print(f"saved checkpoint to {out / 'ckpt.pt'}")
        self.saved = self.iter_num


def parse(argv: list[str]) -> tuple[TrainConfig, dict | None]:
    """TrainConfig from config files and flags; a resumed run (init_from 'resume', or 'auto' with out_dir/ckpt.pt) takes
    each key not given from its checkpoint's run, out_dir and init_from aside (docs/reliability.md "Resume"), and a
    conversion (init_from 'convert:<checkpoint>') each model key not given but n_kv_head from its source. Returns
    that checkpoint too (None if none), for load_model: it is read once."""
    given = given_values(TrainConfig, argv)
    default = {f.name: f.default for f in fields(TrainConfig)}
    init_from = given.get("init_from", default["init_from"])
    try:
        source = checkpoint.parse_source(init_from)
    except ValueError as e:
        raise UserError(str(e)) from e
    if source.pretrained:
        fixed = [f"--{k}" for k in given if k in GPTConfig.__dataclass_fields__ and k not in PRETRAINED_KEYS]
        if fixed:  # the model is the weights' own: a shape key would be recorded but not trained
            raise UserError(f"init_from={init_from} trains its weights' own model: drop {', '.join(fixed)} (of the "
                            f"model keys only {', '.join(PRETRAINED_KEYS)} apply to pretrained weights)")
    ckpt, stored, where = checkpoint.start_from(source, given.get("out_dir", default["out_dir"]))
    given = checked_values(TrainConfig, {k: v for k, v in stored.items() if k in default}, where) | given
    return build(TrainConfig, given), ckpt


def main(cfg: TrainConfig, ckpt: dict | None = None) -> None:
    check_writes_into(cfg.out_dir, "a run", RUN_FILES)  # e.g. not into a dataset or an export
    processes = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's; checked before the ranks connect
    if cfg.gradient_accumulation_steps % processes:
        fits = math.ceil(cfg.gradient_accumulation_steps / processes) * processes
        raise UserError(f"gradient_accumulation_steps={cfg.gradient_accumulation_steps} is not divisible by the "
                        f"{processes} processes (it is the total over them), e.g. {fits}")
    d = runtime.setup_distributed(cfg.device, alone=cfg.parallel == "fsdp")
    try:
        with folder_lock(cfg.out_dir, "train.py") if d.rank == 0 else nullcontext():  # one run in out_dir at a time
            Trainer(cfg, d, ckpt).run()
        if d.world_size > 1:
            dist.barrier()
    finally:
        runtime.teardown_distributed()


if __name__ == "__main__":
    run_cli(lambda parsed: main(*parsed), parse, keys=(TrainConfig,))
