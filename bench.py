"""Benchmarks (results go in the README, not in timed tests). One JSON line per measurement, then a table.

Decoding: tokens/s with the KV cache and with recomputation, for MHA/GQA/MQA variants of one model:
    python bench.py --mode=decode --n_layer=6 --n_head=6 --n_embd=384 --block_size=1024
"""

import json
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from configurator import run_cli
from model import GPT, GPTConfig
from train import resolve_device


@dataclass(slots=True)
class BenchConfig:
    mode: str = "decode"
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    block_size: int = 1024
    vocab_size: int = 256  # a char-level vocabulary
    pos_encoding: str = "learned"
    kv_heads: list[int] = field(default_factory=lambda: [6, 2, 1])  # the variants: MHA, GQA, MQA for 6 heads
    new_tokens: list[int] = field(default_factory=lambda: [256, 1000])
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8])
    recompute_max_batch: int = 1  # recomputation only up to this batch size (it is slow)
    repeats: int = 3  # cached runs per setting, the median is reported
    device: str = "auto"
    dtype: str = "float32"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode != "decode":
            raise ValueError(f"mode={self.mode!r}: only 'decode' exists so far")


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


def bench_decode(cfg: BenchConfig, device: str) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(cfg.seed)
    for g in cfg.kv_heads:
        mcfg = GPTConfig(block_size=cfg.block_size, vocab_size=cfg.vocab_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                         n_kv_head=g, n_embd=cfg.n_embd, pos_encoding=cfg.pos_encoding)
        model = GPT(mcfg).to(device=device, dtype=getattr(torch, cfg.dtype)).eval()
        timed_decode(model, 1, 16, True, gen)  # warm-up
        for batch in cfg.batch_sizes:
            for n in cfg.new_tokens:
                row = {"attention": mcfg.attention_kind, "n_kv_head": g, "batch": batch, "new_tokens": n,
                       "kv_cache_bytes": mcfg.kv_cache_bytes(batch, min(n, cfg.block_size), model.lm_head.weight.dtype)}
                runs = [timed_decode(model, batch, n, True, gen) for _ in range(cfg.repeats)]
                stamps = sorted(runs, key=lambda s: s[-1])[len(runs) // 2]
                row |= {"cache_tok_s": batch * n / stamps[-1], "prefill_ms": 1000 * stamps[0],
                        "step_ms_at_100": step_ms(stamps, 100), "step_ms_at_end": step_ms(stamps, n)}
                if batch <= cfg.recompute_max_batch:
                    stamps = timed_decode(model, batch, n, False, gen)
                    row |= {"recompute_tok_s": batch * n / stamps[-1]}
                    row["speedup"] = row["cache_tok_s"] / row["recompute_tok_s"]
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    out = ["| attention | n_kv_head | batch | new tokens | KV cache | cache tok/s | recompute tok/s | speedup | "
           "step ms @100 | step ms @end |", "|:--|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        rec = f"{r['recompute_tok_s']:,.1f} | {r['speedup']:.1f}x" if "recompute_tok_s" in r else "- | -"
        out.append(f"| {r['attention']} | {r['n_kv_head']} | {r['batch']} | {r['new_tokens']} | "
                   f"{r['kv_cache_bytes'] / 2**20:.2f} MiB | {r['cache_tok_s']:,.1f} | {rec} | "
                   f"{r['step_ms_at_100']:.2f} | {r['step_ms_at_end']:.2f} |")
    return "\n".join(out)


def main(cfg: BenchConfig) -> None:
    device = resolve_device(cfg.device, 0)
    torch.manual_seed(cfg.seed)
    print(f"# decode benchmark on {device} ({torch.get_num_threads()} threads), {cfg.dtype}, torch {torch.__version__}",
          file=sys.stderr)
    print(table(bench_decode(cfg, device)))


if __name__ == "__main__":
    run_cli(main, BenchConfig)
