"""Muon's step time: one matrix at a time (optim.Muon before issue 47, written out here) against
optim.Muon's batched step, on the block matrices of config/train_cpu_fast.py's 4x128 model,
Newton-Schulz in fp32 and in bf16 (docs/performance-cpu.md "Training").

    python scripts/bench_muon.py
"""

import math
import statistics
import time

import torch

from model import GPT, GPTConfig
from smallgpt.optim import NS_COEFFICIENTS, Muon


def orthogonalised_one(
    grad: torch.Tensor, dtype: torch.dtype, steps: int = 5, eps: float = 1e-7
) -> torch.Tensor:
    a, b, c = NS_COEFFICIENTS
    x = grad.to(dtype)
    tall = x.size(0) > x.size(1)
    x = x.T if tall else x
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.T if tall else x).to(grad.dtype)


class MuonOne(Muon):
    """optim.Muon as it was: each matrix's momentum, orthogonalisation and update in turn."""

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = orthogonalised_one(p.grad.lerp(buf, group["momentum"]), self.ns_dtype)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"] * math.sqrt(max(1.0, p.size(0) / p.size(1))))


model = GPT(
    GPTConfig(
        n_layer=4,
        n_head=4,
        n_embd=128,
        block_size=64,
        vocab_size=128,
        pos_encoding="rope",
        bias=False,
    )
)
inner = [p for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("transformer.h.")]
print(
    torch.__version__,
    torch.get_num_threads(),
    "threads,",
    len(inner),
    "matrices:",
    sorted({tuple(p.shape) for p in inner}),
)
for dtype in (torch.float32, torch.bfloat16):
    res = {}
    for name, cls in (("one at a time", MuonOne), ("batched", Muon)):
        params = [torch.nn.Parameter(p.detach().clone()) for p in inner]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = cls(params, lr=0.02, ns_dtype=dtype)
        times = []
        for i in range(60):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        res[name] = statistics.median(times[10:]) * 1000
    print(
        f"{dtype}: "
        + ", ".join(f"{k} {v:.2f} ms" for k, v in res.items())
        + f", speed-up {res['one at a time'] / res['batched']:.2f}x"
    )
