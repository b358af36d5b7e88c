"""Zoology's main figure (arXiv 2312.04927, fig. 2): MQAR accuracy against model width, one panel
per number of key-value pairs, a line per attention variant. For each pair count it prepares an MQAR
dataset in Zoology's layout (data/mqar/prepare.py --layout=zoology), runs compare.py on it at each
width (--sizes), then draws every comparison's MQAR accuracy (on the test split, each variant at
its best rate of --lrs) into one figure and one table.

    python scripts/zoology_mqar.py --pairs=[4,8,16] --widths=[32,64,128] --variants=[mha,mqa] \
        --seq_len=64 --seeds=3 --lrs=[1e-3,3e-3]

Each comparison is an ordinary compare.py folder (<out>/p<pairs>: resumable, its own report.md); the
figure and the table go to <out>/zoology.png and <out>/zoology.md. Train flags beyond these keys
come from config/compare/mqar.py (2 layers, 4 heads, rotary, Muon).
"""

import csv
import runpy
import sys
from dataclasses import dataclass, field
from pathlib import Path

from configurator import run_cli
from smallgpt.atomic import atomic_open
from smallgpt.configs import variant_problems

ROOT = Path(__file__).resolve().parent.parent


@dataclass(slots=True)
class ZoologyConfig:
    pairs: list[int] = field(default_factory=lambda: [4, 8, 16])  # one panel each
    widths: list[int] = field(default_factory=lambda: [32, 64, 128])  # n_embd, at n_layer layers
    n_layer: int = 2
    variants: list[str] = field(default_factory=lambda: ["mha", "mqa"])
    seq_len: int = 64  # tokens an example
    key_vocab: int = 64
    value_vocab: int = 64
    train_examples: int = 20000
    seeds: int = 1
    lrs: list[float] = field(default_factory=list)  # compare.py --lrs; empty: the config's rate
    max_iters: int = 1500
    out: str = "out-zoology"
    data: str = "data"  # where the datasets go: <data>/mqar-zoology-p<pairs>
    # compare.py's decode-speed measurement, kept small: the figure is about accuracy
    speed_repeats: int = 1
    decode_context: int = 4096

    def __post_init__(self) -> None:
        if not self.pairs or not self.widths or min(self.pairs + self.widths) < 1:
            raise ValueError(f"pairs={self.pairs} and widths={self.widths}: give positive sizes")
        problems = variant_problems(self.variants)  # before any dataset is prepared
        if problems:
            raise ValueError("; ".join(problems))


def run(command: list[str]) -> None:
    """A script of the repository run as `python command...` would run it (its command line, its
    output, its exit status), in this process: without the two seconds a fresh interpreter spends
    importing torch. A failure ends this script with that script's own line and exit status."""
    argv = sys.argv
    sys.argv = list(command)
    try:
        runpy.run_path(str(ROOT / command[0]), run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    finally:
        sys.argv = argv


def comparison(cfg: ZoologyConfig, pairs: int) -> Path:
    """The MQAR dataset of pairs pairs in Zoology's layout and compare.py's sweep over the widths
    on it; its folder."""
    data = Path(cfg.data) / f"mqar-zoology-p{pairs}"
    if not (data / "meta.json").is_file():
        run(
            [
                "data/mqar/prepare.py",
                f"--out_dir={data}",
                "--layout=zoology",
                f"--num_pairs={pairs}",
                f"--seq_len={cfg.seq_len}",
                f"--key_vocab={cfg.key_vocab}",
                f"--value_vocab={cfg.value_vocab}",
                f"--train_examples={cfg.train_examples}",
            ]
        )
    out = Path(cfg.out) / f"p{pairs}"
    sizes = ",".join(f"{cfg.n_layer}x{w}" for w in cfg.widths)
    command = [
        "compare.py",
        str(ROOT / "config" / "compare" / "mqar.py"),
        f"--dataset={data}",
        f"--out_dir={out}",
        f"--block_size={cfg.seq_len - 1}",
        f"--sizes=[{sizes}]",
        f"--variants=[{','.join(cfg.variants)}]",
        f"--seeds={cfg.seeds}",
        f"--max_iters={cfg.max_iters}",
        f"--lr_decay_iters={cfg.max_iters}",
        f"--warmup_iters={min(50, cfg.max_iters // 10)}",
        f"--eval_interval={cfg.max_iters}",
        f"--speed_repeats={cfg.speed_repeats}",
        f"--decode_context={cfg.decode_context}",
    ]
    if cfg.lrs:
        command.append(f"--lrs=[{','.join(map(str, cfg.lrs))}]")
    run(command)
    return out


def accuracies(folder: Path) -> dict[str, dict[int, tuple[float, str]]]:
    """A comparison's MQAR accuracy by variant and width: (pooled accuracy, 'k/n' solved)."""
    out: dict[str, dict[int, tuple[float, str]]] = {}
    for row in csv.DictReader(open(folder / "report.csv")):
        if row.get("mqar_acc"):
            width = int(row["size"].split("x")[1])
            solved = f"{row['mqar_solved']}/{row['mqar_runs']}"
            out.setdefault(row["variant"], {})[width] = (float(row["mqar_acc"]), solved)
    return out


def figure(by_pairs: dict[int, dict], path: Path) -> None:
    """One panel per pair count: accuracy against width, a line per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(by_pairs), figsize=(4.2 * len(by_pairs), 3.6), squeeze=False)
    for ax, (pairs, variants) in zip(axes[0], by_pairs.items(), strict=True):
        for variant, by_width in variants.items():
            widths = sorted(by_width)
            ax.plot(widths, [by_width[w][0] for w in widths], marker="o", label=variant)
        ax.set(title=f"{pairs} key-value pairs", xlabel="model width (n_embd)", ylim=(0, 1.02))
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("MQAR accuracy (test)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(by_pairs: dict[int, dict]) -> str:
    """The figure's numbers: a row per pair count and variant, a column per width."""
    widths = sorted({w for v in by_pairs.values() for by_w in v.values() for w in by_w})
    lines = [
        "| pairs | variant | " + " | ".join(f"width {w}" for w in widths) + " |",
        "|---|---|" + "---|" * len(widths),
    ]
    for pairs, variants in by_pairs.items():
        for variant, by_width in variants.items():
            cells = [
                f"{by_width[w][0]:.3f} ({by_width[w][1]} solved)" if w in by_width else "-"
                for w in widths
            ]
            lines.append(f"| {pairs} | {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(cfg: ZoologyConfig) -> None:
    by_pairs = {pairs: accuracies(comparison(cfg, pairs)) for pairs in cfg.pairs}
    out = Path(cfg.out)
    figure(by_pairs, out / "zoology.png")
    text = table(by_pairs)
    with atomic_open(out / "zoology.md", "w") as f:
        f.write(text)
    print(f"{text}\nwrote {out / 'zoology.png'}, {out / 'zoology.md'}")


if __name__ == "__main__":
    run_cli(main, ZoologyConfig)
