"""Train a GPT from a config file: `python train.py config/train_pycode_char.py --n_kv_head=2`.

Single process, or DDP / FSDP under torchrun (nccl on CUDA, gloo on CPU):
    torchrun --standalone --nproc_per_node=4 train.py config/train_gpt2.py [--parallel=fsdp]

Keys: TrainConfig (smallgpt/configs.py, `--help`); from the command to the first step:
docs/architecture.md
"""

# configurator first: a Ctrl-C while torch imports is then one line, not a traceback
import configurator
from smallgpt.errors import UserError

# isort: split
import math
import os
import signal
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, fields, replace
from pathlib import Path

import torch
import torch.distributed as dist

from model import GPT, GPTConfig
from smallgpt import checkpoint, convert, distillation, recall, runtime, sharding
from smallgpt.atomic import check_writes_into, folder_lock, remove_stale_temps
from smallgpt.configs import TrainConfig, parse_train
from smallgpt.data import Batches, data_dir
from smallgpt.measure import evaluate
from smallgpt.optim import lr_at, make_optimizer, state_bytes
from smallgpt.runlog import RunLog

RUN_FILES = ("ckpt.pt", "log.jsonl", "config.json")  # in out_dir (also wandb/, ckpt-*.pt)
# the files written through a temp (atomic.temp_path)
RUN_TEMPS = r"ckpt\.pt|config\.json|ckpt-\d{7,}\.pt"


@torch.no_grad()
def init_model(
    cfg: TrainConfig,
    vocab_size: int,
    device: str,
    dtype: torch.dtype,
    ckpt: dict | None = None,
    batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[GPT, dict | None]:
    """The model to train on device (sharded under FSDP), and the checkpoint it resumes, if any;
    batches: what a conversion into a hybrid ranks and calibrates on."""
    fsdp = cfg.parallel == "fsdp"
    model, ckpt = load_model(cfg, vocab_size, ckpt, batches)
    if model is None and ckpt is None:  # a new model
        config = cfg.model_config(vocab_size)
        return sharding.build(config, device, dtype, cfg.seed, fsdp), None
    if model is None:  # resumed under FSDP: the sharded checkpoint holds the weights
        config = GPTConfig(**ckpt["model_config"])
        return sharding.build(config, device, dtype, None, fsdp), ckpt
    model = model.to(device)
    if fsdp:
        model = sharding.shard(model, device, dtype)
    return model, ckpt


def load_model(
    cfg: TrainConfig,
    vocab_size: int,
    ckpt: dict | None = None,
    batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[GPT | None, dict | None]:
    """init_model's model from weights and the checkpoint it resumes; no model if new or sharded."""
    source = checkpoint.parse_source(cfg.init_from).resolved(cfg.out_dir)
    existing = Path(cfg.out_dir) / "ckpt.pt"
    if source.kind != "resume" and existing.exists():  # never mix two runs' checkpoints or logs
        raise UserError(
            f"{existing} holds another run: --init_from=resume (or auto) continues it; "
            f"to start a new run, choose another out_dir or delete that one first"
        )
    if source.kind != "resume":
        ignored = {"init_from"}
        if source.pretrained:  # pretrained weights set the model keys the run records
            ignored |= {f.name for f in fields(GPTConfig)}
        checkpoint.check_no_other_log(Path(cfg.out_dir), asdict(cfg), ignored)
    if source.kind == "scratch":
        return None, None
    if source.pretrained:
        model = checkpoint.load_run(source, tokenizer=False).model
        model = convert.for_finetuning(
            model, str(source), vocab_size, cfg.dropout, cfg.block_size, cfg.n_kv_head
        )
        return model, None
    resume = source.kind == "resume"
    if ckpt is None:
        ckpt = checkpoint.load_checkpoint(source.checkpoint_path(cfg.out_dir), "cpu", mmap=True)
    # resume: each model key given is the model's or its run's (fine-tuned GPT-2 keeps GPT-2's
    # shape whatever its config said); convert: each but convert.CONVERTED_KEYS is the source's
    wanted = cfg if resume else cfg.model_config(vocab_size)
    run_cfg = checkpoint.run_config(ckpt) if resume else {}
    differ = []
    for key, stored in ckpt["model_config"].items():
        if not hasattr(wanted, key) or (key in convert.CONVERTED_KEYS and not resume):
            continue
        asked = getattr(wanted, key)
        if asked not in (stored, run_cfg.get(key, stored)):
            differ.append(f"{key}: checkpoint {stored!r}, config {asked!r}")
    if differ:
        action = "resume" if resume else "convert"
        where = cfg.out_dir if resume else source.where
        hint = " or use a new out_dir" if resume else ""
        raise UserError(
            f"cannot {action} {where}: the config asks for another model "
            f"({'; '.join(differ)}); drop those overrides{hint}"
        )
    if resume and "sharded" in ckpt and cfg.parallel == "fsdp":
        return None, ckpt
    model = checkpoint.load_run(source, cfg.out_dir, tokenizer=False, ckpt=ckpt).model
    if resume:
        return model, ckpt
    steer = convert.HybridSteer(cfg.convert_layers, cfg.convert_calibrate, batches or [])
    return convert.for_uptraining(model, wanted, cfg.convert_method, cfg.seed, steer), None


def train_step(
    model: torch.nn.Module,
    raw_model: GPT,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    batches: Batches,
    it: int,
    proc: runtime.Dist,
    accum: int,
    amp: AbstractContextManager,
    grad_clip: float,
    skip_nonfinite: bool = False,
    loss_of: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, bool]:
    """One step over this rank's accum micro-batches: their mean loss (no sync), and if taken.
    loss_of(model, x, y): the loss to train on (None: the model's cross-entropy)."""
    loss_sum = torch.zeros((), device=proc.device)
    for micro in range(accum):
        # this rank's micro-batch of the step
        x, y = batches.train(it, proc.rank * accum + micro)
        # forward; gradients sync only on the last micro-step
        last = micro == accum - 1
        with sharding.gradient_sync(model, raw_model, last), amp:
            loss = model(x, y)[1] if loss_of is None else loss_of(model, x, y)
        # backward, scaled for fp16 and averaged over the micro-steps
        scaler.scale(loss / accum).backward()
        loss_sum += loss.detach() / accum
    taken = True
    # clip the gradient (inf: measure its norm, clip nothing)
    if grad_clip > 0 or skip_nonfinite:
        scaler.unscale_(optimizer)
        max_norm = grad_clip if grad_clip > 0 else math.inf
        params = raw_model.parameters()
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if skip_nonfinite:  # one host sync; the norm is the same on every rank
            taken = bool(torch.isfinite(sharding.whole(norm)))
    # step the optimizer, unless the gradient was not finite
    if taken:
        scaler.step(optimizer)
    scaler.update()
    # flush the gradients as soon as we can, no need for this memory anymore
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, taken


def check_early_stop(cfg: TrainConfig, meta: dict, where: str) -> None:
    """A UserError where stop_at_accuracy is given for a dataset that is not MQAR's."""
    if cfg.stop_at_accuracy is not None:
        reader = f"stop_at_accuracy={cfg.stop_at_accuracy} reads the val accuracy on the answers of"
        recall.require_mqar(meta, where, reader, "it out")


class Trainer:
    """One run: set up (data, model, optimizer), restore a checkpoint, then run()'s loop."""

    def __init__(self, cfg: TrainConfig, proc: runtime.Dist, ckpt: dict | None = None) -> None:
        self.cfg = cfg
        self.proc = proc  # this process's rank, world size and device
        self.accum = cfg.gradient_accumulation_steps // proc.world_size  # micro-steps per rank
        self.sharded = cfg.parallel == "fsdp"  # then every rank evaluates and saves (collectives)
        if proc.device_type == "cpu":
            runtime.keep_freed_memory()
        self.place = runtime.place(proc.device, cfg.dtype, cfg.n_embd)  # decided once
        self.amp = self.place.autocast()
        dtype = self.place.dtype
        meta = self.open_data()
        self.stopped = False  # stopped early, at an evaluation that reached stop_at_accuracy
        source = checkpoint.parse_source(cfg.init_from)
        checkpoint.check_pretrained_tokenizer(source, meta, cfg.dataset)  # weights' own tokens only
        self.teacher = self.check_sources(source, meta, ckpt)
        ckpt = self.set_up_model(source, meta, ckpt)
        cfg = self.cfg
        ckpt_meta = ckpt.get("data_meta") if ckpt is not None else None
        checkpoint.check_vocabulary(self.raw_model.config.vocab_size, meta, ckpt_meta, cfg.dataset)
        self.loss_of = None  # the model's cross-entropy, unless distilling from a teacher
        if self.teacher is not None:
            self.loss_of = distillation.loss(cfg, self.raw_model, proc, self.teacher)
        betas = (cfg.beta1, cfg.beta2)
        self.optimizer = make_optimizer(
            self.raw_model,
            cfg.optimizer,
            cfg.weight_decay,
            cfg.learning_rate,
            betas,
            proc.device,
            cfg.muon_lr,
        )
        self.scaler = torch.amp.GradScaler(proc.device_type, enabled=dtype == torch.float16)
        self.iter_num = 0
        self.best_val = math.inf
        self.saved = None  # the iteration of the last good checkpoint
        runtime.seed_rank(cfg.seed, proc.rank)  # dropout's (weights and data have their own)
        resumed = ckpt is not None
        if resumed:
            self.restore(ckpt)
        del ckpt
        trained = self.iter_num >= cfg.max_iters or self.stopped
        self.finished = resumed and trained and not cfg.eval_only
        self.model = torch.compile(self.raw_model) if cfg.compile else self.raw_model
        self.ddp_model = self.model
        if proc.world_size > 1 and not self.sharded:
            cuda_index = proc.local_rank if proc.device_type == "cuda" else None
            self.ddp_model = sharding.ddp(self.model, cuda_index)
        self.log = self.start_log() if proc.is_master and not self.finished else None
        self.tokens_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size
        self.peak = None  # the device's peak FLOP/s, for MFU (rank 0 logs it)
        if proc.is_master:
            self.peak = cfg.peak_flops or runtime.peak_flops(proc.device, dtype)
        self.loss_sum = torch.zeros((), device=proc.device)  # of the steps since the last log
        self.taken_steps = 0
        self.skipped = 0
        self.t_start = self.t_last = time.perf_counter()
        self.last_log = self.iter_num

    def open_data(self) -> dict:
        """The batches of the dataset (self.batches) and its meta, checked against the final
        evals' tasks and an early stop: said now, not after the training."""
        cfg = self.cfg
        data = data_dir(cfg.dataset)
        self.batches = Batches(data, cfg.block_size, cfg.batch_size, cfg.seed, self.proc.device)
        meta = self.batches.meta
        recall.check_dataset(cfg.final_evals, meta, cfg.block_size, str(data))
        check_early_stop(cfg, meta, str(data))
        return meta

    def check_sources(
        self, source: checkpoint.Source, meta: dict, ckpt: dict | None
    ) -> distillation.Teacher | None:
        """Before the conversion's ranking and calibration: a convert: source trained on the
        dataset's tokens (as a resume checks its own), and the teacher a distilling run reads
        (self.cfg then records it); ckpt: the source's or the resumed run's checkpoint."""
        cfg = self.cfg
        if source.kind == "convert":
            checkpoint.check_source_tokens(source, cfg.out_dir, ckpt, meta, cfg.dataset)
        if not cfg.distill:
            return None
        self.cfg = cfg = replace(cfg, teacher=distillation.teacher_of(cfg, source, ckpt))
        resumed = ckpt if source.resolved(cfg.out_dir).kind == "resume" else None
        return distillation.teacher_for(cfg, meta, resumed)

    def set_up_model(self, source: checkpoint.Source, meta: dict, ckpt: dict | None) -> dict | None:
        """self.raw_model (plain state_dict names, uncompiled, not wrapped by DDP; FSDP shards in
        place), and the checkpoint it resumes; self.cfg then records the shape it trains
        (pretrained weights', or the layers a conversion into a hybrid chose)."""
        cfg = self.cfg
        # a conversion into a hybrid ranks and calibrates on 4 training batches, on the CPU
        calibration = None
        if source.kind == "convert":
            calibration = [
                tuple(t.cpu() for t in self.batches.train(0, micro)) for micro in range(4)
            ]
        vocab_size = meta["vocab_size"]
        device = self.proc.device
        dtype = self.place.dtype
        self.raw_model, ckpt = init_model(cfg, vocab_size, device, dtype, ckpt, calibration)
        if source.pretrained or calibration is not None:
            self.cfg = replace(cfg, **asdict(self.raw_model.config))
        return ckpt

    def diverged(self, what: str, value: float) -> UserError:
        """The error that stops a run whose loss or weights went non-finite, logged first (a
        learning-rate sweep counts the run as diverged: compare.py --lrs)."""
        if self.log is not None:
            elapsed = time.perf_counter() - self.t_start
            self.log.write(
                event="diverged", iter=self.iter_num, what=what, value=str(value), elapsed_s=elapsed
            )
        kept = "no checkpoint was written yet"
        if self.saved is not None:
            kept = f"the last good checkpoint (iteration {self.saved}) is kept"
        skip = ""
        if self.cfg.nonfinite != "skip":
            skip = ", or set --nonfinite=skip to drop such steps"
        return UserError(
            f"{what} is {value} at iteration {self.iter_num}: training diverged; "
            f"{kept}; lower learning_rate (or raise warmup_iters){skip}"
        )

    def restore(self, ckpt: dict) -> None:
        """Continue a checkpointed run: optimizer (and sharded weights), scaler, iteration, RNGs."""
        sharding.load_optimizer(ckpt, Path(self.cfg.out_dir), self.raw_model, self.optimizer)
        if ckpt["scaler"]:  # empty when saved by a disabled scaler
            self.scaler.load_state_dict(ckpt["scaler"])
        self.iter_num = ckpt["iter_num"]
        self.best_val = ckpt["best_val_loss"]
        self.stopped = ckpt.get("stopped_early", False)
        self.saved = ckpt["iter_num"]
        if "rng" in ckpt:
            runtime.set_rng_states(ckpt["rng"], self.proc, self.cfg.seed)

    def start_log(self) -> RunLog:
        """Check out_dir, print the config and the model, and open the run log (rank 0 only)."""
        cfg = self.cfg
        model_cfg = self.raw_model.config
        optimizer_bytes = state_bytes(self.optimizer)
        size = checkpoint.size_estimate(self.raw_model, optimizer_bytes, self.batches.meta)
        checkpoint.check_out_dir(Path(cfg.out_dir), size, cfg.keep_last)
        world = self.proc.world_size
        processes = f"{world} processes" if world > 1 else "1 process"
        resumed = "; keys not given: the resumed run's" if self.iter_num else ""
        place = self.place
        print(f"config ({processes}, {place.device}, {place.dtype}: {place.why}{resumed}):")
        configurator.print_config(cfg)
        log = RunLog(cfg, model_cfg, self.iter_num)  # iter_num > 0: resumed
        params = self.raw_model.num_params() / 1e6
        print(f"model: {params:.2f}M parameters, {model_cfg.describe()}")
        return log

    def run(self) -> None:
        """Train to max_iters; on SIGTERM or SIGINT (pre-emption, Ctrl-C) save after the step."""
        if self.finished:  # e.g. --init_from=auto run again after the end
            if self.proc.is_master:
                ckpt = Path(self.cfg.out_dir) / "ckpt.pt"
                if self.stopped:
                    print(
                        f"{ckpt} stopped early at iteration {self.iter_num}, where its val MQAR "
                        f"accuracy reached stop_at_accuracy={self.cfg.stop_at_accuracy}: nothing "
                        "to train (--eval_only=True evaluates it)"
                    )
                else:
                    print(
                        f"{ckpt} is at iteration {self.iter_num}, max_iters={self.cfg.max_iters}: "
                        "nothing to train (raise --max_iters to train on, or --eval_only=True to "
                        "evaluate)"
                    )
            return
        signals: list[int] = []
        previous = {
            sig: signal.signal(sig, lambda signum, _: signals.append(signum))
            for sig in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            self.train_loop(signals)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self.log is not None:
                self.log.close()

    def train_loop(self, signals: list[int]) -> None:
        """Each iteration: set the lr, evaluate and save when due, step, log, stop if signalled."""
        cfg = self.cfg
        proc = self.proc
        while True:
            # determine and set the learning rate for this iteration
            lr = lr_at(
                self.iter_num,
                cfg.learning_rate,
                cfg.min_lr,
                cfg.warmup_iters,
                cfg.lr_decay_iters,
                cfg.decay_lr,
            )
            for group in self.optimizer.param_groups:  # a checkpoint from before lr_scale has none
                group["lr"] = lr * group.get("lr_scale", 1.0)
            # evaluate the loss on train/val sets and write checkpoints
            skip_first = self.iter_num == 0 and not cfg.eval_at_start
            at_eval = self.iter_num % cfg.eval_interval == 0 and not skip_first
            if at_eval or self.iter_num == cfg.max_iters or cfg.eval_only:
                rng = runtime.rng_states(proc)  # every rank's (a collective): a resume starts here
                if proc.is_master or self.sharded:
                    self.evaluate_and_save(lr, rng)
                if cfg.stop_at_accuracy is not None and proc.world_size > 1 and not self.sharded:
                    self.stopped = sharding.from_rank0(self.stopped)  # rank 0 evaluated alone
            if cfg.eval_only or self.iter_num >= cfg.max_iters or self.stopped:
                break
            # forward, backward and update
            self.step()
            # timing and logging
            last = self.iter_num == cfg.max_iters
            at_log = self.iter_num % cfg.log_interval == 0 or last
            if at_log:
                self.log_progress(lr)
            # on a signal: save after this step and stop
            if runtime.stop_requested(signals, proc, at_log):
                rng = runtime.rng_states(proc)
                if proc.is_master:
                    why = signal.Signals(signals[0]).name if signals else "a signal to another rank"
                    print(f"stopping on {why} at iteration {self.iter_num}")
                if proc.is_master or self.sharded:
                    self.save(rng)
                break

    def step(self) -> None:
        skip_nonfinite = self.cfg.nonfinite == "skip"
        loss, taken = train_step(
            self.ddp_model,
            self.raw_model,
            self.optimizer,
            self.scaler,
            self.batches,
            self.iter_num,
            self.proc,
            self.accum,
            self.amp,
            self.cfg.grad_clip,
            skip_nonfinite,
            self.loss_of,
        )
        self.iter_num += 1
        if taken:
            self.loss_sum += loss
            self.taken_steps += 1
        else:
            self.skipped += 1

    def evaluate_and_save(self, lr: float, rng: list[dict]) -> None:
        """Evaluate, log, and save a checkpoint if val loss improved (or always_save_checkpoint);
        stop early where the val MQAR accuracy reached stop_at_accuracy (saved, the final
        evaluation)."""
        cfg = self.cfg
        # the val accuracy on MQAR's answers: what an early stop reads at every evaluation, and what
        # a capacity curve chooses its rate on at the final one
        stops = cfg.stop_at_accuracy is not None
        at_end = self.iter_num == cfg.max_iters or cfg.eval_only
        val_mqar = self.val_mqar() if stops or (at_end and "mqar" in cfg.final_evals) else None
        lowest = recall.weakest(val_mqar) if stops else None
        if stops and lowest >= cfg.stop_at_accuracy and self.iter_num > 0 and not cfg.eval_only:
            self.stopped = True
            if self.proc.is_master:
                print(
                    f"step {self.iter_num}: val MQAR accuracy {lowest:.4f} (on the pair count "
                    f"recalled worst) reached stop_at_accuracy={cfg.stop_at_accuracy}: "
                    "stopping early"
                )
                self.log.write(event="stop", iter=self.iter_num, val_mqar=val_mqar)
        final = at_end or self.stopped
        # the test split, where the dataset has one, at the final evaluation only: what a choice
        # made on val (compare.py --lrs) is measured on
        splits = self.batches.splits if final else ("train", "val")
        losses = evaluate(self.model, self.batches, cfg.eval_iters, self.amp, splits)
        if self.sharded:  # every rank evaluated the same batches; all decide as rank 0 does
            losses = sharding.from_rank0(losses)
        val = losses["val"]
        if not math.isfinite(val):
            raise self.diverged("the val loss", val)
        if self.proc.is_master:
            test = f", test loss {losses['test']:.4f}" if "test" in losses else ""
            print(
                f"step {self.iter_num}: train loss {losses['train']:.4f}, val loss {val:.4f}{test}"
            )
            self.log.write(
                event="eval",
                iter=self.iter_num,
                train_loss=losses["train"],
                val_loss=val,
                **({"test_loss": losses["test"]} if "test" in losses else {}),
                **({"val_mqar": val_mqar} if val_mqar is not None else {}),
                lr=lr,
                elapsed_s=time.perf_counter() - self.t_start,
            )
        improved = val < self.best_val or cfg.always_save_checkpoint or self.stopped
        # not before the first step, nor again at the iteration it resumed from (saved)
        if self.iter_num not in (0, self.saved) and not cfg.eval_only and improved:
            self.best_val = min(self.best_val, val)
            self.save(rng)
        if cfg.final_evals and final:
            self.final_evals()
        self.t_last = time.perf_counter()  # ms/iter leaves evaluation out

    def val_mqar(self) -> dict:
        """The val split's MQAR accuracy (recall.mqar), every rank as rank 0 has it."""
        cfg = self.cfg
        self.model.eval()
        try:
            result = recall.mqar(self.model, self.batches, cfg.eval_iters, self.amp, split="val")
        finally:
            self.model.train()
        return sharding.from_rank0(result) if self.sharded else result

    def final_evals(self) -> None:
        """smallgpt/recall.py's tasks on the final model (induction, position, MQAR), in one
        record."""
        cfg = self.cfg
        split = self.batches.held_out  # what position and mqar read
        results = recall.run_tasks(
            cfg.final_evals,
            self.model,
            self.batches,
            cfg.eval_iters,
            batch_size=cfg.batch_size,
            seed=cfg.seed,
            amp=self.amp,
            split=split,
        )
        if self.proc.is_master:
            print(f"step {self.iter_num}: {recall.summary_line(results)}")
            elapsed = time.perf_counter() - self.t_start
            self.log.write(
                event="recall", iter=self.iter_num, split=split, **results, elapsed_s=elapsed
            )
            self.log.summarize(recall.flat(results))

    def log_progress(self, lr: float) -> None:
        """The mean loss since the last log (all ranks), speed and MFU; a NaN/inf loss stops."""
        proc = self.proc
        if proc.world_size > 1:  # a collective on every rank, only at log steps
            dist.all_reduce(self.loss_sum)
        train_loss = math.nan  # every step since the last log was skipped
        if self.taken_steps:
            train_loss = self.loss_sum.item() / proc.world_size / self.taken_steps  # a host sync
            if not math.isfinite(train_loss):
                raise self.diverged("the training loss", train_loss)
        now = time.perf_counter()
        dt = (now - self.t_last) / (self.iter_num - self.last_log)
        self.t_last = now
        self.last_log = self.iter_num
        self.taken_steps = 0
        self.loss_sum.zero_()
        if not proc.is_master:
            return
        tok_s = self.tokens_per_iter / dt  # all processes together
        flops = self.raw_model.flops_per_token(self.cfg.block_size) * tok_s / proc.world_size
        probed = proc.device_type == "cpu" and not self.cfg.peak_flops
        if self.peak and flops > self.peak and probed:  # MFU over 100%: the probe shared the cores
            self.peak = max(self.peak, runtime.peak_flops(proc.device, self.place.dtype))
        mfu = flops / self.peak if self.peak else None
        progress = f"iter {self.iter_num}: loss {train_loss:.4f}, lr {lr:.2e}, "
        progress += f"{dt * 1000:.1f} ms/iter, {tok_s:,.0f} tok/s"
        if mfu is not None:
            progress += f", mfu {mfu:.1%}"
        if self.skipped:
            progress += f", {self.skipped} non-finite steps skipped so far"
        print(progress)
        self.log.write(
            event="train",
            iter=self.iter_num,
            loss=train_loss,
            lr=lr,
            ms_per_iter=dt * 1000,
            tokens_per_s=tok_s,
            mfu=mfu,
            skipped=self.skipped,
            elapsed_s=now - self.t_start,
        )

    def teacher_record(self) -> dict:
        """What a distilling run's checkpoint records of its teacher's weights ({} without one):
        a resume refuses a teacher trained on since (distillation.teacher_for)."""
        if self.teacher is None:
            return {}
        return {"teacher_weights": self.teacher.weights}

    def save(self, rng: list[dict]) -> None:
        """Write out_dir/ckpt.pt with every rank's RNG states (FSDP: after the sharded one)."""
        out = Path(self.cfg.out_dir)
        model = self.raw_model
        if not sharding.all_finite(model):
            raise self.diverged("a weight", math.nan)
        state = sharding.checkpoint_state(out, self.iter_num, model, self.optimizer)  # collective
        if self.proc.is_master:
            checkpoint.save_checkpoint(
                out / "ckpt.pt",
                model,
                keep_last=self.cfg.keep_last,
                scaler=self.scaler.state_dict(),
                iter_num=self.iter_num,
                best_val_loss=self.best_val,
                config=asdict(self.cfg),
                data_meta=self.batches.meta,
                rng=rng,
                stopped_early=self.stopped,
                **state,
                **self.teacher_record(),
            )
            sharding.prune_sharded(out, self.iter_num)  # also an FSDP run's, resumed without FSDP
            print(f"saved checkpoint to {out / 'ckpt.pt'}")
        self.saved = self.iter_num


def main(cfg: TrainConfig, ckpt: dict | None = None) -> None:
    check_writes_into(cfg.out_dir, "a run", RUN_FILES)  # e.g. not into a dataset or an export
    processes = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's; checked before ranks connect
    accum = cfg.gradient_accumulation_steps
    if accum % processes:
        fits = math.ceil(accum / processes) * processes
        raise UserError(
            f"gradient_accumulation_steps={accum} is not divisible by the {processes} "
            f"processes (it is the total over them), e.g. {fits}"
        )
    proc = runtime.setup_distributed(cfg.device, alone=cfg.parallel == "fsdp")
    try:
        lock = folder_lock(cfg.out_dir, "train.py") if proc.rank == 0 else nullcontext()
        with lock:  # one run in out_dir at a time
            if proc.rank == 0:  # what a killed run left half-written (no other writer: the lock)
                remove_stale_temps(cfg.out_dir, RUN_TEMPS)
            Trainer(cfg, proc, ckpt).run()
        if proc.world_size > 1:
            dist.barrier()
    finally:
        runtime.teardown_distributed()


if __name__ == "__main__":
    configurator.run_cli(lambda parsed: main(*parsed), parse_train, keys=(TrainConfig,))
