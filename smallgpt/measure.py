"""What bench.py, smallgpt/bench_peers.py and compare.py measure and print with: the MHA/GQA/MQA
variants of a model, timed decoding (from a prompt, and cached steps at long context), timed
training steps (a sweep's plan), the loss on a dataset's fixed evaluation batches (train.py's
evaluations), and markdown tables.
"""

import dataclasses
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from model import GPT, GPTConfig
from smallgpt.data import Batches
from smallgpt.generation import stream
from smallgpt.optim import make_optimizer
from smallgpt.runtime import Placement, synchronize


def default_kv_heads(n_head: int) -> list[int]:
    """The variants to compare: n_head (MHA), the middle divisor (GQA) and 1 (MQA)."""
    divisors = [g for g in range(2, n_head) if n_head % g == 0]
    return sorted({n_head, 1, *divisors[len(divisors) // 2 :][:1]}, reverse=True)


def evaluate(
    model: torch.nn.Module,
    batches: Batches,
    eval_iters: int,
    amp: AbstractContextManager,
    splits: tuple[str, ...] = ("train", "val"),
) -> dict[str, float]:
    """Mean loss over eval_iters fixed batches of each split."""
    model.eval()
    out = {}
    for split in splits:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            with amp:
                _, loss = model(*batches.eval(split, k))
            losses[k] = loss.item()
        out[split] = losses.mean().item()
    model.train()
    return out


def timed_decode(
    model: GPT,
    batch: int,
    new_tokens: int,
    use_cache: bool,
    gen: torch.Generator,
    compile_step: bool = False,
) -> list[float]:
    """Seconds at which each new token was ready, from the start (prefill of a 1-token prompt
    included)."""
    idx = torch.randint(0, model.config.vocab_size, (batch, 1), generator=gen).to(
        model.transformer.wte.weight.device
    )
    synchronize(idx.device)
    t0 = time.perf_counter()
    stamps = []
    for _ in stream(
        model, idx, new_tokens, temperature=0, use_cache=use_cache, compile_step=compile_step
    ):
        synchronize(idx.device)
        stamps.append(time.perf_counter() - t0)
    return stamps


def cached_step_throughput(
    config: GPTConfig, batch: int, context: int, steps: int, device: str
) -> float:
    """Tokens/s of one-token decode steps for `batch` rows with `context` positions already cached
    (the median step of `steps`): the memory-bound regime, where every step reads the whole KV
    cache. A model of config's shape with random weights (speed does not depend on their values),
    float32, its block_size stretched to fit."""
    torch.manual_seed(0)
    model = (
        GPT(dataclasses.replace(config, block_size=context + steps, dropout=0.0)).to(device).eval()
    )
    idx = torch.randint(0, config.vocab_size, (batch, context + steps), device=device)
    times = []
    with torch.inference_mode():
        cache = model.make_kv_cache(batch)
        model(idx[:, :context], kv_cache=cache)
        for t in range(context, context + steps):
            synchronize(device)
            t0 = time.perf_counter()
            model(idx[:, t : t + 1], kv_cache=cache)
            synchronize(device)
            times.append(time.perf_counter() - t0)
    return batch / statistics.median(times)


def training_seconds(
    config: GPTConfig, batch_size: int, optimizer: str, place: Placement, steps: int = 5
) -> tuple[float, float]:
    """Seconds of a training step (forward, backward, optimizer step; the median of steps after a
    warm-up) and of an evaluation forward, on a (batch_size, block_size) batch of random tokens, for
    a model of config's shape."""
    device = place.device
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(config, dropout=0.0)).to(device)
    opt = make_optimizer(model, optimizer, 0.1, 1e-4, (0.9, 0.99), device, 1e-3)
    amp = place.autocast()
    x = torch.randint(0, config.vocab_size, (batch_size, config.block_size + 1), device=device)

    def timed(fn: Callable[[], None], n: int) -> float:
        times = []
        for _ in range(n + 1):  # the first one warms up
            synchronize(device)
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    def step() -> None:
        with amp:
            loss = model(x[:, :-1], x[:, 1:])[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def forward() -> None:
        with torch.no_grad(), amp:
            model(x[:, :-1], x[:, 1:])

    return timed(step, steps), timed(forward, 3)


def step_ms(stamps: list[float], at: int, width: int = 20) -> float:
    """Median time of one decode step around context length `at`, in ms."""
    lo = max(1, min(at, len(stamps) - 1) - width // 2)
    return 1000 * statistics.median(
        b - a for a, b in zip(stamps[lo - 1 : lo + width - 1], stamps[lo : lo + width])
    )


def table(rows: list[dict], columns: dict[str, str] | None = None) -> str:
    """A markdown table of rows: the given {key: header} columns, or every key."""
    columns = columns or {k: k for r in rows for k in r}

    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:,.1f}" if abs(v) >= 100 else f"{v:.4f}".rstrip("0").rstrip(".")
        if v is None:
            return "-"
        if isinstance(v, int) and not isinstance(v, bool):
            return f"{v:,}"
        return str(v)

    lines = ["| " + " | ".join(columns.values()) + " |", "|" + "---|" * len(columns)]
    return "\n".join(
        lines + ["| " + " | ".join(fmt(r.get(k)) for k in columns) + " |" for r in rows]
    )
