"""Where a training step of a config's model goes (config/train_cpu_fast.py's by default), and at
what FLOP/s: the forward, the backward and the optimizer (Muon's Newton-Schulz for the blocks'
matrices, AdamW for the rest, or AdamW alone) timed apart (the median of 20 steps after 5, random
tokens, bf16 autocast where the box has native bf16), each part's FLOPs by formula, against the
CPU's measured matmul peak (runtime.peak_flops). docs/performance-cpu.md "Where the step's time
goes".

    python scripts/step_flops.py [config/train_pycode_char.py]
"""

import statistics
import sys
import time

import torch

from model import GPT
from smallgpt import runtime
from smallgpt.configs import parse_train
from smallgpt.optim import Muon, make_optimizer


def newton_schulz_flops(model: GPT, steps: int = 5) -> int:
    """Muon's orthogonalisation of every matrix in the blocks: per iteration on (r, c), r <= c:
    X X^T (2 r r c), the Gram matrix squared (2 r r r) and that polynomial times X (2 r r c)."""
    total = 0
    for name, p in model.named_parameters():
        if p.dim() == 2 and name.startswith("transformer.h."):
            r, c = sorted(p.shape)
            total += steps * (4 * r * r * c + 2 * r**3)
    return total


def main() -> None:
    config = sys.argv[1] if len(sys.argv) > 1 else "config/train_cpu_fast.py"
    cfg, _ = parse_train([config, "--vocab_size=222"])
    dtype = runtime.resolve_dtype(cfg.dtype, "cpu", cfg.n_embd)[0]
    torch.manual_seed(0)
    model = GPT(cfg.model_config(222))
    opt = make_optimizer(
        model,
        cfg.optimizer,
        cfg.weight_decay,
        cfg.learning_rate,
        (cfg.beta1, cfg.beta2),
        "cpu",
        cfg.muon_lr,
    )
    amp = runtime.autocast("cpu", dtype)
    x = torch.randint(0, 222, (cfg.batch_size, cfg.block_size))  # pycode_char's 222 symbols
    parts = {"forward": [], "backward": [], "optimizer": []}
    for i in range(25):
        t0 = time.perf_counter()
        with amp:
            _, loss = model(x, x)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if i >= 5:
            for part, seconds in zip(parts, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                parts[part].append(seconds)
    tokens = cfg.batch_size * cfg.block_size
    model_flops = (
        model.flops_per_token(cfg.block_size) * tokens
    )  # forward + backward (PaLM's 6N + attention)
    muon = [o for o in getattr(opt, "optimizers", [opt]) if isinstance(o, Muon)]
    optimizer = f"Newton-Schulz in {muon[0].ns_dtype}" if muon else "AdamW (its FLOPs left out)"
    flops = {
        "forward": model_flops / 3,
        "backward": 2 * model_flops / 3,
        "optimizer": newton_schulz_flops(model) if muon else 0,
    }
    peak = runtime.peak_flops("cpu", dtype)
    print(
        f"# {config}: {cfg.n_layer}x{cfg.n_embd}, "
        f"batch {cfg.batch_size} x {cfg.block_size}, {dtype}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"matmul peak {peak / 1e9:.0f} GFLOP/s; {optimizer}"
    )
    print("| part | ms (median of 20) | GFLOP | GFLOP/s | of peak |")
    print("|---|---|---|---|---|")
    for part, times in parts.items():
        ms = 1000 * statistics.median(times)
        rate = flops[part] / (ms / 1000)
        print(
            f"| {part} | {ms:.1f} | {flops[part] / 1e9:.3f} | "
            f"{rate / 1e9:.1f} | {rate / peak:.1%} |"
        )
    print(f"| step | {1000 * sum(statistics.median(t) for t in parts.values()):.1f} | | | |")


if __name__ == "__main__":
    main()
