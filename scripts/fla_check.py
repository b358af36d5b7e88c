"""On a CUDA machine with flash-linear-attention installed: its chunked gated delta rule (what
delta_rule.on_kernels runs) against this project's torch form (delta_rule.chunked) in float64, the
oracle, at a GPT-2 124M hybrid layer's shape; outputs, final state and every input's gradient,
from a nonzero state, T not a multiple of the chunk. Then the rule's forward + backward time on
each path. Called by `bash scripts/gpu_check.sh hybrids`; prints one JSON line per row (docs/gpu.md
has what it gave)."""

import json
import time

import torch
import torch.nn.functional as F

from smallgpt import delta_rule

B, H, T, D = 16, 12, 1000, 64  # 12 heads of 64 (768 wide), 1,000 tokens: 15 chunks and a part


def inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    """q, k, v, g, b and a state as the layer gives them: q and k unit rows (q scaled by
    1/sqrt(D)), g = -A dt with A in [1, 16] and dt in [0.001, 0.1] (the layer's initial range)."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float64)

    def uniform(low: float, high: float, *shape: int) -> torch.Tensor:
        u = torch.rand(*shape, generator=gen, device="cuda", dtype=torch.float64)
        return low + (high - low) * u

    q = F.normalize(draw(B, H, T, D), dim=-1) * D**-0.5
    k = F.normalize(draw(B, H, T, D), dim=-1)
    v = draw(B, H, T, D)
    g = -uniform(1, 16, B, H, 1) * uniform(0.001, 0.1, B, H, T)
    b = torch.sigmoid(draw(B, H, T))
    state = draw(B, H, D, D) * 0.1
    return [x.to(dtype).requires_grad_() for x in (q, k, v, g, b, state)]


def run_forward(path: str, xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v, g, b, state = xs
    if path.startswith("fla"):
        dtype = torch.bfloat16 if path.endswith("bf16") else torch.float32
        kernel = delta_rule.FLA
        return delta_rule.on_kernels(kernel, q, k, v, g, b, state, dtype)
    return delta_rule.chunked(q, k, v, g, b, state)


def run(path: str, xs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The output, the final state and the gradients of a fixed random projection of both (or
    only the first two where the backward is refused)."""
    out, final = run_forward(path, xs)
    # the projection drawn in float64 whatever the path's dtype: the same numbers for every path
    gen = torch.Generator(device="cuda").manual_seed(1)
    w_out = torch.randn(out.shape, generator=gen, device="cuda", dtype=torch.float64)
    w_final = torch.randn(final.shape, generator=gen, device="cuda", dtype=torch.float64)
    loss = (out * w_out.to(out.dtype)).sum() + (final * w_final.to(final.dtype)).sum()
    try:
        grads = torch.autograd.grad(loss, xs)
    except RuntimeError as e:  # fla refuses some backward passes (Triton < 3.7.1 on Hopper)
        print(json.dumps({"path": path, "backward": str(e).splitlines()[0]}), flush=True)
        return (out, final)
    return (out, final, *grads)


def relative_errors(got: tuple[torch.Tensor, ...], oracle: tuple[torch.Tensor, ...]) -> dict:
    names = ["out", "state", "dq", "dk", "dv", "dg", "db", "dstate"]
    return {
        name: ((x.double() - ref).norm() / ref.norm()).item()
        for name, x, ref in zip(names, got, oracle[: len(got)], strict=False)
    }


def timed(path: str, backward: bool, repeats: int = 10) -> float:
    """Median ms of one forward + backward, or of the forward alone."""
    xs = inputs(torch.float32)
    times = []
    for _ in range(repeats + 3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if backward:
            run(path, xs)
        else:
            with torch.no_grad():
                run_forward(path, xs)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1000 * sorted(times[3:])[repeats // 2]


def main() -> None:
    assert delta_rule.FLA is not None, "flash-linear-attention is not importable"
    oracle = run("torch", inputs(torch.float64))
    # each path's inputs in fp32; fla-bf16 casts q, k and v to bf16 as the layer does under autocast
    for path in ("torch", "fla", "fla-bf16"):
        if path != "torch":  # the kernels' forward alone (prefill), compiled by Triton here
            xs = [x.detach() for x in inputs(torch.float32)]
            with torch.no_grad():
                t0 = time.perf_counter()
                run_forward(path, xs)
                torch.cuda.synchronize()
            print(json.dumps({"path": path, "first_forward_s": time.perf_counter() - t0}))
        got = run(path, inputs(torch.float32))
        errors = relative_errors(got, oracle)
        row = {"path": path, "shape": [B, H, T, D]} | {k: f"{e:.2e}" for k, e in errors.items()}
        row["fwd_ms"] = round(timed(path, False), 2)
        if len(got) > 2:
            row["fwd_bwd_ms"] = round(timed(path, True), 2)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
