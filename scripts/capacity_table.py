"""The capacity curves' table (and figure) from the per-run results a comparison keeps
(<out_dir>/capacity.csv, smallgpt/capacity.py), without training: the files of a protocol's parts,
run on different days or machines and committed beside docs/compare.md, read together.

    python scripts/capacity_table.py --files=[docs/capacity/part-a.csv,docs/capacity/part-b.csv] \
        --png=docs/compare-capacity.png

Prints the markdown table compare.py's report gives (each pair count at its rate of the highest
mean val accuracy, the seeds' test accuracies, the solved k/n with its interval, and each
variant's knee), then each variant's rates side by side (the mean val accuracy at the smallest
count and the seeds that solved every count: where the rate search stands). A run listed twice
(the same variant, pair count, seed and rate in two files) is one line of error, not counted
twice. Parts of other sizes (7:1 at 8 layers beside the 4-layer ones) are told apart: each variant
is then named by its size too ("8x64 mha").
"""

from dataclasses import dataclass, field
from pathlib import Path

from configurator import run_cli  # first: a Ctrl-C while the libraries import is then one line

# isort: split
from smallgpt import capacity
from smallgpt.configs import SOLVED_THRESHOLD
from smallgpt.errors import UserError
from smallgpt.plots import capacity_figure


@dataclass(slots=True)
class TableConfig:
    files: list[str] = field(default_factory=list)  # capacity.csv files, read together
    solved_threshold: float = SOLVED_THRESHOLD  # compare.py's: a seed at this solved its count
    png: str = ""  # also draw the curves into this file


def main(cfg: TableConfig) -> None:
    if not cfg.files:
        raise UserError("--files=[...]: give the capacity.csv files to read")
    results = capacity.sized(r for f in cfg.files for r in capacity.read_results(Path(f)))
    seen: dict[tuple, int] = {}
    for r in results:
        where = (r.variant, r.pairs, r.seed, r.lr)
        seen[where] = seen.get(where, 0) + 1
    if twice := [w for w, n in seen.items() if n > 1]:
        variant, pairs, seed, lr = twice[0]
        raise UserError(
            f"{variant} at {pairs} pairs, seed {seed}, rate {lr:g} is in the files {seen[twice[0]]}"
            f" times ({len(twice)} such runs): give each part's file once"
        )
    curves = capacity.curves(results, cfg.solved_threshold)
    print(capacity.table(curves), end="")
    rows = capacity.by_rate(results, cfg.solved_threshold)
    print(
        f"\nBy rate: the mean val accuracy at {min(r.pairs for r in rows)} pairs (the smallest "
        "count), and the seeds that solved every count:\n"
    )
    print(capacity.rates_table(rows), end="")
    if cfg.png:
        capacity_figure(curves, Path(cfg.png))
        print(f"wrote {cfg.png}")


if __name__ == "__main__":
    run_cli(main, TableConfig)
