"""How precisely a run's evaluation knows its loss: the trained model of RUN on N of its fixed
evaluation batches (Batches.eval, as train.py evaluates), per split the mean loss over the first
eval_iters and over all N, the per-batch standard deviation, the 95% half-width of a mean of n
batches (stats.t_quantile(n - 1) sd / sqrt(n), stats.mean_interval's formula) at eval_iters, and the
batches a half-width of 0.005 would take (docs/performance-cpu.md "Where the step's time goes").

    python scripts/eval_precision.py RUN [N]
"""

import math
import statistics
import sys
import time

import torch

from smallgpt import runtime
from smallgpt.checkpoint import load_run, parse_source
from smallgpt.data import Batches, data_dir
from smallgpt.stats import t_quantile


def main(run_dir: str, n: int) -> None:
    run = load_run(parse_source("resume"), run_dir, tokenizer=False)
    cfg, model = run.config, run.model.eval()
    batches = Batches(
        data_dir(cfg["dataset"]), cfg["block_size"], cfg["batch_size"], cfg["seed"], "cpu"
    )
    dtype = runtime.resolve_dtype(cfg["dtype"], "cpu", cfg["n_embd"])[0]
    amp = runtime.autocast("cpu", dtype)
    for split in ("val", "train"):
        losses, times = [], []
        with torch.no_grad():
            for k in range(n):
                t0 = time.perf_counter()
                with amp:
                    _, loss = model(*batches.eval(split, k))
                losses.append(loss.item())
                times.append(time.perf_counter() - t0)
        sd, first = statistics.stdev(losses), cfg["eval_iters"]
        means = (
            f"mean of {first} {statistics.fmean(losses[:first]):.4f}, "
            f"of {n} {statistics.fmean(losses):.4f}"
        )
        half = t_quantile(first - 1) * sd / math.sqrt(first)
        needed = math.ceil(
            (t_quantile(n - 1) * sd / 0.005) ** 2
        )  # t at the n measured, about the normal's 1.96
        print(
            f"{split}: {means}; per-batch sd {sd:.4f}; 95% half-width at {first}: {half:.4f}; "
            f"batches for 0.005: {needed}; "
            f"{1000 * statistics.median(times):.1f} ms a batch ({dtype})"
        )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 400)
