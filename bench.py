"""Benchmarks (results go in the README, not in timed tests): one JSON line per measurement, then a table.

    python bench.py --mode=train config/train_shakespeare_char.py --device=cpu --batch_size=8 --dropout=0.0
    python bench.py --mode=decode --block_size=1024 --vocab_size=256

The model, device and dtype come from train.py's config files and flags; the keys of BenchConfig steer the bench.
"""

import dataclasses
import json
import re
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

import model as model_module
from configurator import parse_config, run_cli, split_args
from dataset import vocab_size_of
from model import GPT, GPTConfig
from train import Dist, TrainConfig, keep_freed_memory, peak_flops, resolve_device, resolve_dtype, train_step


@dataclass(slots=True)
class BenchConfig:
    mode: str = "decode"  # 'train', 'decode', or against peers (bench_peers.py): 'hf', 'nanogpt'
    # train: every combination of these, on random tokens (speed does not depend on the data)
    compiles: list[bool] = field(default_factory=lambda: [False, True])
    dtypes: list[str] = field(default_factory=lambda: ["float32", "bfloat16"])
    warmup: int = 3  # iterations left out (compilation happens here)
    iters: int = 10  # measured iterations; the median is reported
    # decode: MHA/GQA/MQA variants of the model, from a 1-token prompt, greedy
    kv_heads: list[int] = field(default_factory=list)  # empty: n_head, a middle divisor, 1
    new_tokens: list[int] = field(default_factory=lambda: [256, 1000])
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8])
    recompute_max_batch: int = 1  # recomputation only up to this batch size (it is slow)
    repeats: int = 3  # cached runs per setting, the median is reported
    nanogpt_dir: str = ""  # nanogpt: a karpathy/nanoGPT checkout, outside this repository
    linear_split: bool = True  # False: few-row products through nn.Linear's own path (model.SPLIT_MAX_ROWS = 0)

    def __post_init__(self) -> None:
        if self.mode not in ("train", "decode", "hf", "nanogpt"):
            raise ValueError(f"mode={self.mode!r} must be 'train', 'decode', 'hf' or 'nanogpt'")


def default_kv_heads(n_head: int) -> list[int]:
    """n_head (MHA), the middle divisor (GQA) and 1 (MQA)."""
    divisors = [g for g in range(2, n_head) if n_head % g == 0]
    return sorted({n_head, 1, *divisors[len(divisors) // 2:][:1]}, reverse=True)


class RandomBatches:
    def __init__(self, base: TrainConfig, vocab_size: int, device: str) -> None:
        self.shape, self.vocab_size, self.device = (base.batch_size, base.block_size + 1), vocab_size, device

    def train(self, it: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        buf = torch.randint(0, self.vocab_size, self.shape, device=self.device)
        return buf[:, :-1], buf[:, 1:]


def bench_train(cfg: BenchConfig, base: TrainConfig, mcfg: GPTConfig, device: str) -> list[dict]:
    rows, device_type = [], device.split(":")[0]
    d = Dist(0, 0, 1, device, True)
    batches = RandomBatches(base, mcfg.vocab_size, device)
    tokens_per_iter = base.gradient_accumulation_steps * base.batch_size * base.block_size
    sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
    if device_type == "cpu":
        keep_freed_memory()  # as train.py does
    for dtype_name in cfg.dtypes:
        dtype = resolve_dtype(dtype_name, device_type)
        peak = base.peak_flops or peak_flops(device, dtype)
        for compiled in cfg.compiles:
            torch.manual_seed(base.seed)
            raw = GPT(mcfg).to(device)
            opt = raw.configure_optimizers(base.weight_decay, base.learning_rate, (base.beta1, base.beta2),
                                           device_type)
            scaler = torch.amp.GradScaler(device_type, enabled=dtype == torch.float16)
            model = torch.compile(raw) if compiled else raw
            autocast = nullcontext() if dtype == torch.float32 else torch.autocast(device_type, dtype=dtype)
            times = []
            for it in range(cfg.warmup + cfg.iters):
                t0 = time.perf_counter()
                loss = train_step(model, raw, opt, scaler, batches, it, d, base.gradient_accumulation_steps,
                                  autocast, base.grad_clip)[0].item()
                sync()
                times.append(time.perf_counter() - t0)
            dt = statistics.median(times[cfg.warmup:])
            flops = raw.flops_per_token(base.block_size)
            row = {"mode": "train", "device": device, "dtype": dtype_name, "compile": compiled,
                   "ms_per_iter": 1000 * dt, "tokens_per_s": tokens_per_iter / dt, "flops_per_token": flops,
                   "peak_flops": peak, "mfu": flops * tokens_per_iter / dt / peak if peak else None, "loss": loss}
            row |= {"peak_tflops": peak / 1e12 if peak else None, "mfu_pct": 100 * row["mfu"] if peak else None}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def timed_decode(model: GPT, batch: int, new_tokens: int, use_cache: bool, gen: torch.Generator) -> list[float]:
    """Seconds at which each new token was ready, from the start (prefill of a 1-token prompt included)."""
    idx = torch.randint(0, model.config.vocab_size, (batch, 1), generator=gen).to(model.lm_head.weight.device)
    sync = torch.cuda.synchronize if idx.is_cuda else (lambda: None)
    sync()
    t0, stamps = time.perf_counter(), []
    for _ in model.stream(idx, new_tokens, temperature=0, use_cache=use_cache):
        sync()
        stamps.append(time.perf_counter() - t0)
    return stamps


def step_ms(stamps: list[float], at: int, width: int = 20) -> float:
    """Median time of one decode step around context length `at`, in ms."""
    lo = max(1, min(at, len(stamps) - 1) - width // 2)
    return 1000 * statistics.median(b - a for a, b in zip(stamps[lo - 1:lo + width - 1], stamps[lo:lo + width]))


def bench_decode(cfg: BenchConfig, base: GPTConfig, device: str, dtype: torch.dtype) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for g in cfg.kv_heads or default_kv_heads(base.n_head):
        mcfg = dataclasses.replace(base, n_kv_head=g)
        model = GPT(mcfg).to(device=device, dtype=dtype).eval()
        weight_bytes = sum(m.weight.nbytes for m in model.modules() if isinstance(m, torch.nn.Linear))
        timed_decode(model, 1, 16, True, gen)  # warm-up
        for batch in cfg.batch_sizes:
            for n in cfg.new_tokens:
                ctx = min(n, mcfg.block_size)  # positions cached at the end
                row = {"mode": "decode", "attention": mcfg.attention_kind, "n_kv_head": g, "batch": batch,
                       "new_tokens": n, "kv_cache_bytes": mcfg.kv_cache_bytes(batch, ctx, dtype),
                       "weight_bytes": weight_bytes}
                runs = [timed_decode(model, batch, n, True, gen) for _ in range(cfg.repeats)]
                stamps = sorted(runs, key=lambda s: s[-1])[len(runs) // 2]
                row |= {"cache_tok_s": batch * n / stamps[-1], "prefill_ms": 1000 * stamps[0],
                        "step_ms_at_100": step_ms(stamps, 100), "step_ms_at_end": step_ms(stamps, n)}
                # a step at the end reads every weight once and the whole cache once
                row["gb_s_at_end"] = (weight_bytes + row["kv_cache_bytes"]) / row["step_ms_at_end"] / 1e6
                if batch <= cfg.recompute_max_batch:
                    row["recompute_tok_s"] = batch * n / timed_decode(model, batch, n, False, gen)[-1]
                    row["speedup"] = row["cache_tok_s"] / row["recompute_tok_s"]
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def table(rows: list[dict], columns: dict[str, str] | None = None) -> str:
    """A markdown table of rows: the given {key: header} columns, or every key."""
    columns = columns or {k: k for r in rows for k in r}

    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:,.1f}" if abs(v) >= 100 else f"{v:.4f}".rstrip("0").rstrip(".")
        return "-" if v is None else f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)

    lines = ["| " + " | ".join(columns.values()) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(fmt(r.get(k)) for k in columns) + " |" for r in rows])


def parse(argv: list[str]) -> tuple[BenchConfig, TrainConfig, list[str]]:
    ours, train_args = split_args(argv, BenchConfig)
    return parse_config(BenchConfig, ours), parse_config(TrainConfig, train_args), train_args


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX), where bf16 autocast pays off."""
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.is_file() and bool(re.search(r"\b(avx512_bf16|amx_bf16)\b", cpuinfo.read_text()))


def main(config: tuple[BenchConfig, TrainConfig, list[str]]) -> None:
    cfg, base, train_args = config
    device = resolve_device(base.device, 0)
    mcfg = base.model_config(vocab_size=vocab_size_of(base.dataset) or 50304)
    print(f"# {cfg.mode} benchmark on {device} ({torch.get_num_threads()} threads), torch {torch.__version__}, "
          f"{mcfg.n_layer} layers, {mcfg.n_head} heads, {mcfg.n_embd} wide, vocab {mcfg.vocab_size}", file=sys.stderr)
    if cfg.mode in ("hf", "nanogpt"):
        import bench_peers  # here, not at the top: it imports compare.py, which imports this module
    if cfg.mode == "hf":
        rows = bench_peers.bench_hf(mcfg, cfg.new_tokens, cfg.dtypes, cfg.repeats, device)
        print(table(rows, {"dtype": "dtype", "new_tokens": "new tokens", "hf_tok_s": "Hugging Face tok/s",
                           "ours_tok_s": "ours tok/s", "speedup": "speedup", "same_tokens": "same tokens"}))
    elif cfg.mode == "nanogpt":
        dtype = "bfloat16" if native_bf16() else "float32"
        step = parse_config(TrainConfig, [*bench_peers.STEP_SHAPE, "--device=cpu", "--vocab_size=65"])
        rows = bench_peers.bench_nanogpt(cfg.nanogpt_dir, base.dataset, train_args, lambda: {
            r["compile"]: r["ms_per_iter"] for r in bench_train(dataclasses.replace(cfg, dtypes=[dtype]), step,
                                                                  step.model_config(65), "cpu")})
        print(f"(ours: the 6x384 step in {dtype} autocast)")
        print(table(rows[:1]) + "\n\n" + table(rows[1:]))
    elif cfg.mode == "train":
        rows = bench_train(cfg, base, mcfg, device)
        print(table(rows, {"dtype": "dtype", "compile": "compile", "ms_per_iter": "ms/iter",
                           "tokens_per_s": "tokens/s", "mfu_pct": "MFU %", "peak_tflops": "peak TFLOP/s",
                           "loss": "loss"}))
    else:
        model_module.SPLIT_MAX_ROWS = model_module.SPLIT_MAX_ROWS if cfg.linear_split else 0
        rows = bench_decode(cfg, mcfg, device, resolve_dtype(base.dtype, device.split(":")[0]))
        print(table(rows, {"attention": "attention", "n_kv_head": "n_kv_head", "batch": "batch",
                           "new_tokens": "new tokens",
                           "kv_cache_bytes": "KV cache bytes", "cache_tok_s": "cache tok/s",
                           "recompute_tok_s": "recompute tok/s", "speedup": "speedup",
                           "step_ms_at_100": "step ms @100", "step_ms_at_end": "step ms @end",
                           "gb_s_at_end": "GB/s @end"}))


if __name__ == "__main__":
    run_cli(main, parse)
