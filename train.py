"""Train a GPT from a config file: `python train.py config/train_pycode_char.py --n_kv_head=2`.

Single process, or DDP under torchrun (nccl on CUDA, gloo on CPU):
    torchrun --standalone --nproc_per_node=4 train.py config/train_gpt2.py
"""

import ctypes
import json
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.parse
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from configurator import print_config, run_cli
from dataset import data_dir, load_meta, open_tokens
from model import (
    GPT,
    GPTConfig,
    convert_kv_heads,
    from_hf_gpt2,
    load_checkpoint,
    model_from_checkpoint,
    save_checkpoint,
)

MODEL_FIELDS = [f.name for f in fields(GPTConfig)]
GPT2_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
# Dense peak FLOP/s by GPU name from datasheets, without sparsity: (bf16/fp16 tensor cores, plain fp32).
# Longer names first: the first name found in torch.cuda.get_device_name() wins ("A100" before "A10").
GPU_PEAK_FLOPS = {"H200": (989e12, 67e12), "H100": (989e12, 67e12), "A100": (312e12, 19.5e12),
                  "L40S": (362e12, 91.6e12), "L40": (181e12, 90.5e12), "L4": (121e12, 30.3e12),
                  "A10": (125e12, 31.2e12),
                  "4090": (165e12, 82.6e12), "3090": (71e12, 35.6e12), "V100": (125e12, 15.7e12),
                  "T4": (65e12, 8.1e12)}


@dataclass(slots=True)
class TrainConfig:
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
    # heads mean-pooled into n_kv_head groups: MHA -> GQA/MQA uptraining), or OpenAI's GPT-2: 'gpt2', 'gpt2-medium',
    # 'gpt2-large', 'gpt2-xl' or 'hf:<local folder>' (model keys other than dropout, block_size, n_kv_head ignored)
    init_from: str = "scratch"
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
    block_size: int = 256
    # model (see GPTConfig); vocab_size None takes the dataset's
    n_layer: int = 6
    n_head: int = 6
    n_kv_head: int | None = None
    n_embd: int = 384
    dropout: float = 0.0
    bias: bool = False
    pos_encoding: str = "learned"
    rope_theta: float = 10000.0
    gelu: str = "exact"
    vocab_size: int | None = None
    # AdamW and the learning-rate schedule (linear warm-up, cosine decay to min_lr)
    learning_rate: float = 1e-3
    max_iters: int = 5000
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # 0 disables clipping
    # a NaN/inf loss: 'stop' (seen at log steps, no extra host sync; the last good checkpoint stays) or 'skip' (drop
    # every step whose gradient is not finite: one host sync per step)
    nonfinite: str = "stop"
    decay_lr: bool = True
    warmup_iters: int = 100
    lr_decay_iters: int = 5000
    min_lr: float = 1e-4
    # system
    device: str = "auto"  # 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'
    dtype: str = "auto"  # 'auto' (bfloat16 on CUDA when supported, else float32), 'float32', 'bfloat16', 'float16'
    compile: bool = False
    seed: int = 1337
    peak_flops: float | None = None  # the device's peak FLOP/s for MFU; None: a GPU table or a CPU probe

    def __post_init__(self) -> None:
        positive = ["eval_interval", "log_interval", "eval_iters", "gradient_accumulation_steps", "batch_size",
                    "block_size"]
        problems = [f"{k}={getattr(self, k)} must be positive" for k in positive if getattr(self, k) < 1]
        problems += [f"{k}={getattr(self, k)} must not be negative" for k in ("max_iters", "warmup_iters",
                     "lr_decay_iters", "learning_rate", "min_lr", "weight_decay", "grad_clip") if getattr(self, k) < 0]
        problems += [f"keep_last={self.keep_last} must not be negative"] if self.keep_last < 0 else []
        if self.nonfinite not in ("stop", "skip"):
            problems.append(f"nonfinite={self.nonfinite!r} must be 'stop' or 'skip'")
        named = self.init_from in ("scratch", "resume", "auto", *GPT2_NAMES)
        if not named and not self.init_from.startswith(("convert:", "hf:")):
            problems.append(f"init_from={self.init_from!r} must be 'scratch', 'resume', 'auto', "
                            f"'convert:<checkpoint>', {', '.join(GPT2_NAMES)} or 'hf:<folder from save_pretrained>'")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            problems.append(f"dtype={self.dtype!r} must be one of auto, float32, bfloat16, float16")
        if problems:
            raise ValueError("invalid config: " + "; ".join(problems))
        if self.init_from in ("scratch", "auto") or self.init_from.startswith("convert:"):  # else from weights
            self.model_config(vocab_size=1)  # the model's own checks (n_head % n_kv_head, ...), before any work

    def model_config(self, vocab_size: int) -> GPTConfig:
        return GPTConfig(**{k: getattr(self, k) for k in MODEL_FIELDS} | {"vocab_size": self.vocab_size or vocab_size})


@dataclass(slots=True)
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: str
    is_master: bool


def resolve_device(name: str, local_rank: int) -> str:
    if name == "auto":
        if torch.cuda.is_available():
            return f"cuda:{local_rank}"
        return "mps" if torch.backends.mps.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device={name!r} but this machine has no CUDA GPU that torch can use; use --device=cpu")
    if name == "mps" and not torch.backends.mps.is_available():
        raise RuntimeError("device='mps' but MPS is not available here; use --device=cpu")
    return f"cuda:{local_rank}" if name == "cuda" else name


def setup_distributed(device: str) -> Dist:
    """Join the torchrun process group when RANK/LOCAL_RANK/WORLD_SIZE are set (nccl on CUDA, gloo otherwise)."""
    if "RANK" not in os.environ:
        return Dist(0, 0, 1, resolve_device(device, 0), True)
    rank, local_rank, world = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    dev = resolve_device(device, local_rank)
    if dev.startswith("cuda"):
        torch.cuda.set_device(dev)
    try:
        dist.init_process_group(backend="nccl" if dev.startswith("cuda") else "gloo")
    except RuntimeError as e:
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            raise
        raise RuntimeError(f"{e}; a torchrun restart can read the previous attempt's addresses (pytorch issue "
                           f"135712): launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1") from e
    return Dist(rank, local_rank, world, dev, rank == 0)


def resolve_dtype(name: str, device_type: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device_type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    if name == "float16" and device_type != "cuda":
        raise ValueError(f"dtype='float16' needs a GradScaler, which runs on CUDA only (device is {device_type}); "
                         f"use bfloat16 or float32")
    return getattr(torch, name)


def peak_flops(device: str, dtype: torch.dtype) -> float | None:
    """The device's dense peak FLOP/s in dtype: the datasheet for known GPUs, the best of five short matmul probes
    on CPU, else None (then MFU is not reported; TrainConfig.peak_flops overrides all of this)."""
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(device)
        peaks = next((v for k, v in GPU_PEAK_FLOPS.items() if k in name), None)
        return None if peaks is None else peaks[dtype == torch.float32]
    if device != "cpu":
        return None
    a = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0)).to(dtype)  # leaves the global RNG be
    a @ a  # warm-up
    rates = []
    for _ in range(5):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 0.05:
            a @ a
            n += 1
        rates.append(2 * 1024**3 * n / (time.perf_counter() - t0))
    return max(rates)


class Batches:
    """Random windows of block_size + 1 tokens. The batch of (iteration, micro-step) depends on the seed alone,
    so a run draws the same data with any number of DDP ranks, and again when resumed."""

    def __init__(self, cfg: TrainConfig, device: str) -> None:
        self.path, self.cfg, self.device = data_dir(cfg.dataset), cfg, device
        self.meta = load_meta(self.path)
        for split in ("train", "val"):
            n = len(open_tokens(self.path, split, self.meta))
            if n <= cfg.block_size:
                raise ValueError(f"the {split} split of {self.path} has {n} tokens, fewer than block_size+1="
                                 f"{cfg.block_size + 1}; lower block_size or use more data")

    def get(self, split: str, *key: int) -> tuple[torch.Tensor, torch.Tensor]:
        data = open_tokens(self.path, split, self.meta)  # a fresh memmap each time avoids a slow memory build-up
        rng = np.random.default_rng([self.cfg.seed, *key])
        T = self.cfg.block_size
        ix = rng.integers(0, len(data) - T, size=self.cfg.batch_size)
        buf = torch.from_numpy(np.stack([data[i:i + T + 1] for i in ix]).astype(np.int64))  # (B, T + 1)
        if self.device.startswith("cuda"):
            buf = buf.pin_memory().to(self.device, non_blocking=True)
        return buf[:, :-1], buf[:, 1:]

    def train(self, it: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get("train", 0, it, micro)

    def eval(self, split: str, k: int) -> tuple[torch.Tensor, torch.Tensor]:  # the same batches at every eval
        return self.get(split, 1, ("train", "val").index(split), k)


def keep_freed_memory() -> None:
    """With glibc, keep freed memory in the process instead of returning it to the system. A CPU training step frees
    its activations and allocates them again the next step; returned memory comes back as fresh pages, one fault per
    4 KiB: ~30,000 faults and 10-15% of a 6x384 bf16 step on the test CPU (README Performance), none after this.
    The cost: the process keeps its peak memory. A no-op without glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # mallopt parameters (malloc.h)
    libc.mallopt(m_mmap_threshold, 32 * 2**20)  # blocks up to 32 MiB (glibc's maximum) come from the heap ...
    libc.mallopt(m_trim_threshold, 2**30)  # ... and the heap is not shrunk until 1 GiB of it is free


def lr_at(it: int, cfg: TrainConfig) -> float:
    if not cfg.decay_lr:
        return cfg.learning_rate
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it >= cfg.lr_decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Batches, eval_iters: int, autocast: Any) -> dict[str, float]:
    model.eval()
    out = {}
    for split in ("train", "val"):
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            with autocast:
                losses[k] = model(*batches.eval(split, k))[1].item()
        out[split] = losses.mean().item()
    model.train()
    return out


class RunLog:
    """Metrics to out_dir/log.jsonl (appended, one JSON object per line) and, if enabled, to wandb."""

    def __init__(self, cfg: TrainConfig, model_cfg: GPTConfig, start_iter: int) -> None:
        self.path = Path(cfg.out_dir) / "log.jsonl"
        self.wandb = None
        if cfg.wandb_log:
            if os.environ.get("WANDB_MODE") == "":  # an empty WANDB_MODE crashes wandb.init
                del os.environ["WANDB_MODE"]
            import wandb

            name = cfg.wandb_run_name or f"{Path(cfg.dataset).name}-{model_cfg.attention_kind}"
            mode = None  # WANDB_MODE's, else online
            url = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
            if os.environ.get("WANDB_MODE", "online") == "online" and (why := unreachable(url)):
                mode = "offline"  # online wandb would wait ~100 s for a network that is not there
                print(f"wandb: cannot reach {url} ({why}): logging offline to {cfg.out_dir}/wandb instead; upload it "
                      f"later with `wandb sync`, or set WANDB_MODE=offline to skip this check")
            try:
                self.wandb = wandb.init(project=cfg.wandb_project, name=name, group=cfg.wandb_group, mode=mode,
                                        tags=cfg.wandb_tags, config=asdict(cfg), dir=cfg.out_dir)
            except Exception as e:  # wandb raises its own errors (no API key, no network)
                raise RuntimeError(f"wandb could not start ({type(e).__name__}: {str(e).splitlines()[0]}); "
                                   f"set WANDB_MODE=offline to log locally, or --wandb_log=False") from e
        self.write(event="config", config=asdict(cfg), model_config=asdict(model_cfg), start_iter=start_iter,
                   versions=versions())

    def write(self, **record: Any) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record | {"time": time.time()}) + "\n")
        if self.wandb is not None and "iter" in record:
            self.wandb.log({k: v for k, v in record.items() if isinstance(v, int | float)}, step=record["iter"])

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


def unreachable(url: str, timeout: float = 3.0) -> str | None:
    """Why no TCP connection to url's host opens within timeout, or None if one does."""
    u = urllib.parse.urlparse(url)
    try:
        socket.create_connection((u.hostname, u.port or (443 if u.scheme == "https" else 80)), timeout=timeout).close()
    except OSError as e:
        return str(e) or type(e).__name__
    return None


def versions() -> dict[str, str | None]:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).parent).stdout.strip() or None
    except OSError:
        sha = None
    return {"git_sha": sha, "python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__}


def rng_states(device_type: str) -> dict[str, Any]:
    """The random generators' states (dropout), for an exact resume; batches need none (seeded per iteration)."""
    cuda = {"cuda": torch.cuda.get_rng_state_all()} if device_type == "cuda" else {}
    return {"torch": torch.get_rng_state()} | cuda


def stop_requested(signals: list[int], d: Dist, at_log: bool) -> bool:
    """Whether a signal asked the run to stop; under DDP the ranks agree on it at log steps, so all stop together."""
    if d.world_size == 1:
        return bool(signals)
    if not at_log:
        return False
    flag = torch.tensor(float(bool(signals)), device=d.device)
    dist.all_reduce(flag)
    return flag.item() > 0


def main(cfg: TrainConfig) -> None:
    d = setup_distributed(cfg.device)
    try:
        train(cfg, d)
        if d.world_size > 1:
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def init_model(cfg: TrainConfig, vocab_size: int, device: str) -> tuple[GPT, dict | None]:
    """The model to train: new, resumed from out_dir (the checkpoint is returned too), converted to n_kv_head, or
    GPT-2's."""
    init_from = cfg.init_from
    if init_from == "auto":
        init_from = "resume" if (Path(cfg.out_dir) / "ckpt.pt").exists() else "scratch"
    if init_from in GPT2_NAMES or init_from.startswith("hf:"):
        return from_pretrained(cfg, vocab_size), None
    if init_from == "scratch":
        return GPT(cfg.model_config(vocab_size)), None
    resume = init_from == "resume"
    path = Path(cfg.out_dir if resume else init_from.removeprefix("convert:"))
    ckpt = load_checkpoint(path if path.suffix == ".pt" else path / "ckpt.pt", device)
    # resume: the model keys changed since the checkpoint's run (a fine-tuned GPT-2 keeps GPT-2's shape);
    # convert: every model key but n_kv_head must match the source
    before, now = (ckpt.get("config", {}), cfg) if resume else (ckpt["model_config"], cfg.model_config(vocab_size))
    differ = [f"{k}: checkpoint {v!r}, config {getattr(now, k)!r}" for k, v in ckpt["model_config"].items()
              if k in before and before[k] != getattr(now, k) and (resume or k != "n_kv_head")]
    if differ:
        raise ValueError(f"cannot {'resume' if resume else 'convert'} {path}: the config asks for another model "
                         f"({'; '.join(differ)}); drop those overrides{' or use a new out_dir' if resume else ''}")
    model = model_from_checkpoint(ckpt)
    return (model, ckpt) if resume else (convert_kv_heads(model, now.n_kv_head), None)


def from_pretrained(cfg: TrainConfig, vocab_size: int) -> GPT:
    """GPT-2 weights with this run's dropout, cropped to its block_size, and pooled to its n_kv_head if fewer."""
    model = from_hf_gpt2(cfg.init_from.removeprefix("hf:"))
    if vocab_size > model.config.vocab_size:
        raise ValueError(f"the dataset's vocab_size={vocab_size} exceeds GPT-2's {model.config.vocab_size}: "
                         f"fine-tune GPT-2 on a GPT-2 BPE dataset (e.g. data/shakespeare)")
    config = replace(model.config, dropout=cfg.dropout, block_size=min(cfg.block_size, model.config.block_size))
    state = model.state_dict()
    state["transformer.wpe.weight"] = state["transformer.wpe.weight"][: config.block_size]
    model = GPT(config)
    model.load_state_dict(state)
    return convert_kv_heads(model, cfg.n_kv_head) if cfg.n_kv_head else model


def train_step(model: torch.nn.Module, raw_model: GPT, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
               batches: Batches, it: int, d: Dist, accum: int, autocast: Any, grad_clip: float,
               skip_nonfinite: bool = False) -> tuple[torch.Tensor, bool]:
    """One optimizer step over this rank's accum micro-batches; returns their mean loss (a tensor: no host sync) and
    whether the step was taken: skip_nonfinite drops a step whose gradient norm is NaN/inf (the same on every rank,
    as gradients are all-reduced), at the cost of one host sync."""
    loss_sum = torch.zeros((), device=d.device)
    for micro in range(accum):
        x, y = batches.train(it, d.rank * accum + micro)
        sync = model.no_sync() if d.world_size > 1 and micro < accum - 1 else nullcontext()  # all-reduce once
        with sync, autocast:
            _, loss = model(x, y)
        scaler.scale(loss / accum).backward()
        loss_sum += loss.detach() / accum
    taken = True
    if grad_clip > 0 or skip_nonfinite:
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), grad_clip if grad_clip > 0 else math.inf)
        taken = not skip_nonfinite or bool(torch.isfinite(norm))
    if taken:
        scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, taken


def check_out_dir(out_dir: Path, need_bytes: int) -> None:
    """Fail before training, not at the first save, if out_dir is not writable or has too little free space."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=out_dir):
        pass
    free = shutil.disk_usage(out_dir).free
    if free < need_bytes:
        raise OSError(f"out_dir {out_dir} has {free / 2**20:,.1f} MiB free, but a checkpoint needs about "
                      f"{need_bytes / 2**20:,.1f} MiB: free some space or choose another out_dir")


def diverged(what: str, value: float, iter_num: int, saved: int | None) -> RuntimeError:
    kept = "no checkpoint was written yet" if saved is None else f"the last good checkpoint (iteration {saved}) is kept"
    return RuntimeError(f"{what} is {value} at iteration {iter_num}: training diverged; {kept}; lower learning_rate "
                        f"(or raise warmup_iters), or set --nonfinite=skip to drop such steps")


def train(cfg: TrainConfig, d: Dist) -> None:
    if cfg.gradient_accumulation_steps % d.world_size:
        raise ValueError(f"gradient_accumulation_steps={cfg.gradient_accumulation_steps} is not divisible by the "
                         f"{d.world_size} DDP processes")
    accum = cfg.gradient_accumulation_steps // d.world_size
    device_type = d.device.split(":")[0]
    if device_type == "cpu":
        keep_freed_memory()
    dtype = resolve_dtype(cfg.dtype, device_type)
    autocast = nullcontext() if dtype == torch.float32 else torch.autocast(device_type, dtype=dtype)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank; data draws depend on (seed, step) only
    batches = Batches(cfg, d.device)
    raw_model, ckpt = init_model(cfg, batches.meta["vocab_size"], d.device)
    model_cfg = raw_model.config
    raw_model.to(d.device)
    optimizer = raw_model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), device_type)
    scaler = torch.amp.GradScaler(device_type, enabled=dtype == torch.float16)
    iter_num, best_val = 0, float("inf")
    saved = None if ckpt is None else ckpt["iter_num"]  # the iteration of the last good checkpoint
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        if ckpt["scaler"]:  # empty when saved by a disabled scaler
            scaler.load_state_dict(ckpt["scaler"])
        iter_num, best_val = ckpt["iter_num"], ckpt["best_val_loss"]
        if "rng" in ckpt:  # dropout draws continue where the checkpointed run left them
            torch.set_rng_state(ckpt["rng"]["torch"].cpu())
            if "cuda" in ckpt["rng"] and device_type == "cuda":
                torch.cuda.set_rng_state_all([s.cpu() for s in ckpt["rng"]["cuda"]])
    del ckpt
    model = torch.compile(raw_model) if cfg.compile else raw_model  # raw_model keeps plain state_dict names
    ddp_model = DDP(model, device_ids=[d.local_rank] if device_type == "cuda" else None,
                    broadcast_buffers=False) if d.world_size > 1 else model
    log = None
    if d.is_master:  # a checkpoint holds the weights and AdamW's two moments (and a few small things)
        check_out_dir(Path(cfg.out_dir), 3 * sum(p.nbytes for p in raw_model.parameters()) + 2**20)
        print(f"config ({d.world_size} process{'es' if d.world_size > 1 else ''}, {d.device}, {dtype}):")
        print_config(cfg)
        (Path(cfg.out_dir) / "config.json").write_text(json.dumps(asdict(cfg), indent=1))
        log = RunLog(cfg, model_cfg, iter_num)  # iter_num > 0: resumed
        print(f"model: {raw_model.num_params() / 1e6:.2f}M parameters, {model_cfg.attention_kind} "
              f"(n_head={model_cfg.n_head}, n_kv_head={model_cfg.n_kv_head}), {model_cfg.pos_encoding} positions")
    tokens_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size
    peak = (cfg.peak_flops or peak_flops(d.device, dtype)) if d.is_master else None
    t_start = t_last = time.perf_counter()
    last_log, loss_sum, taken_steps, skipped = iter_num, torch.zeros((), device=d.device), 0, 0

    def save() -> None:
        nonlocal saved
        if not all(bool(p.isfinite().all()) for p in raw_model.parameters()):  # never overwrite a good checkpoint
            raise diverged("a weight", math.nan, iter_num, saved)
        out = Path(cfg.out_dir)
        save_checkpoint(out / "ckpt.pt", raw_model, optimizer=optimizer.state_dict(), scaler=scaler.state_dict(),
                        iter_num=iter_num, best_val_loss=best_val, config=asdict(cfg), data_meta=batches.meta,
                        rng=rng_states(device_type))
        saved = iter_num
        if cfg.keep_last:
            kept = out / f"ckpt-{iter_num:07d}.pt"
            kept.unlink(missing_ok=True)
            try:
                os.link(out / "ckpt.pt", kept)  # ckpt.pt is replaced by the next save, never rewritten in place
            except OSError:  # a file system without hard links
                shutil.copyfile(out / "ckpt.pt", kept)
            for old in sorted(out.glob("ckpt-*.pt"))[:-cfg.keep_last]:
                old.unlink()
        print(f"saved checkpoint to {out / 'ckpt.pt'}")

    signals: list[int] = []  # SIGTERM/SIGINT (pre-emption, Ctrl-C): finish the step, save, exit cleanly
    previous = {sig: signal.signal(sig, lambda signum, _: signals.append(signum))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            lr = lr_at(iter_num, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            at_eval = iter_num % cfg.eval_interval == 0 and (iter_num > 0 or cfg.eval_at_start)
            if d.is_master and (at_eval or iter_num == cfg.max_iters or cfg.eval_only):
                losses = evaluate(model, batches, cfg.eval_iters, autocast)
                if not math.isfinite(losses["val"]):
                    raise diverged("the val loss", losses["val"], iter_num, saved)
                print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
                log.write(event="eval", iter=iter_num, train_loss=losses["train"], val_loss=losses["val"], lr=lr,
                          elapsed_s=time.perf_counter() - t_start)
                improved = losses["val"] < best_val or cfg.always_save_checkpoint
                if iter_num not in (0, saved) and not cfg.eval_only and improved:  # saved: the iteration resumed at
                    best_val = min(best_val, losses["val"])
                    save()
                t_last = time.perf_counter()  # ms/iter leaves evaluation out
            if cfg.eval_only or iter_num >= cfg.max_iters:
                break
            loss, taken = train_step(ddp_model, raw_model, optimizer, scaler, batches, iter_num, d, accum, autocast,
                                     cfg.grad_clip, cfg.nonfinite == "skip")
            iter_num += 1
            if taken:
                loss_sum += loss
                taken_steps += 1
            else:
                skipped += 1
            at_log = iter_num % cfg.log_interval == 0 or iter_num == cfg.max_iters
            if at_log:
                if d.world_size > 1:  # a collective on every rank, only at log steps
                    dist.all_reduce(loss_sum)
                train_loss = loss_sum.item() / d.world_size / taken_steps if taken_steps else math.nan  # host sync
                if taken_steps and not math.isfinite(train_loss):
                    raise diverged("the training loss", train_loss, iter_num, saved)
                now = time.perf_counter()
                dt = (now - t_last) / (iter_num - last_log)
                t_last, last_log = now, iter_num
                loss_sum.zero_()
                taken_steps = 0
                if d.is_master:
                    mfu = raw_model.estimate_mfu(tokens_per_iter, dt, peak, cfg.block_size) if peak else None
                    print(f"iter {iter_num}: loss {train_loss:.4f}, lr {lr:.2e}, {dt * 1000:.1f} ms/iter, "
                          f"{tokens_per_iter / dt:,.0f} tok/s" + (f", mfu {mfu:.1%}" if mfu is not None else "")
                          + (f", {skipped} non-finite steps skipped so far" if skipped else ""))
                    log.write(event="train", iter=iter_num, loss=train_loss, lr=lr, ms_per_iter=dt * 1000,
                              tokens_per_s=tokens_per_iter / dt, mfu=mfu, skipped=skipped, elapsed_s=now - t_start)
            if stop_requested(signals, d, at_log):
                if d.is_master:
                    print(f"stopping on {signal.Signals(signals[0]).name if signals else 'a signal to another rank'} "
                          f"at iteration {iter_num}")
                    save()
                break
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if log is not None:
            log.close()


if __name__ == "__main__":
    run_cli(main, TrainConfig)
