"""bench.py --mode=delta: the gated delta rule alone, the compiled CPU kernel
(smallgpt/delta_rule_kernel.py) against the torch path (delta_rule.chunked, in each kind's
chunk), forward and forward + backward, with a decay a head (Gated DeltaNet) and a channel
(KDA), at train.py's batch_size x block_size, n_head heads of n_embd / n_head features. Figures
in docs/performance-cpu.md "The delta-rule kernel"."""

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from smallgpt import delta_rule, delta_rule_kernel

# each decay's chunk on the torch path: the chunk of the kind that has it (a head's decay: Gated
# DeltaNet's, 64 tokens; a channel's: Kimi Delta Attention's, 32), written here as numbers, since
# no code outside a kind's file names it (tests/test_layout.py)
CHUNKS = {"head": 64, "channel": 32}


def rule_inputs(B: int, H: int, T: int, d: int, decay: str, seed: int) -> list[torch.Tensor]:
    """q, k (unit rows, q scaled), v, g and b as the layers give them, fp32, needing gradients."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, H, T, d, generator=gen), dim=-1) * d**-0.5
    k = F.normalize(torch.randn(B, H, T, d, generator=gen), dim=-1)
    v = torch.randn(B, H, T, d, generator=gen)
    g_shape = (B, H, T, d) if decay == "channel" else (B, H, T)
    g = -torch.rand(g_shape, generator=gen)
    b = torch.rand(B, H, T, generator=gen)
    return [x.requires_grad_() for x in (q, k, v, g, b)]


def median_ms(run: Callable[[], None], warmup: int, iters: int) -> float:
    """The median milliseconds of run after warmup calls."""
    times = []
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        run()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def bench_rule(B: int, H: int, T: int, d: int, warmup: int, iters: int, seed: int) -> list[dict]:
    """A row for each decay and path: forward and forward + backward milliseconds, and for the
    kernel its speed-up over the torch path."""
    rows = []
    for decay, chunk in CHUNKS.items():
        xs = rule_inputs(B, H, T, d, decay, seed)
        paths = {
            "kernel": lambda *a: delta_rule_kernel.run(*a, None),
            "torch": lambda *a, chunk=chunk: delta_rule.chunked(*a, None, chunk),
        }
        times = {}
        for path, rule in paths.items():

            def forward(rule: Callable = rule) -> None:
                with torch.no_grad():
                    rule(*xs)

            def forward_backward(rule: Callable = rule) -> None:
                out, state = rule(*xs)
                torch.autograd.grad(out.sum() + state.sum(), xs)

            times[path] = (
                median_ms(forward, warmup, iters),
                median_ms(forward_backward, warmup, iters),
            )
        for path, (fwd, fwd_bwd) in times.items():
            row = {
                "mode": "delta",
                "shape": f"{T}x{B}, H={H}, d={d}",
                "decay": decay,
                "path": path,
                "fwd_ms": fwd,
                "fwd_bwd_ms": fwd_bwd,
            }
            if path == "kernel":
                row["fwd_speedup"] = times["torch"][0] / fwd
                row["fwd_bwd_speedup"] = times["torch"][1] / fwd_bwd
            rows.append(row)
    return rows
