"""Zoology's main figure (arXiv 2312.04927, fig. 2): MQAR accuracy against model width, one panel
per number of key-value pairs, a line per attention variant. For each pair count it prepares an MQAR
dataset in Zoology's layout (data/mqar/prepare.py --layout=zoology), runs compare.py on it at each
width (--sizes), then draws every comparison's MQAR accuracy (on the test split, each variant at
its best rate of --lrs) into one figure and one table.

    python scripts/zoology_mqar.py --pairs=[4,8,16] --widths=[32,64,128] --variants=[mha,mqa] \
        --seq_len=64 --seeds=3 --lrs=[1e-3,3e-3]

Each comparison is an ordinary compare.py folder (<out>/p<pairs>: resumable, its own report.md); the
figure and the table go to <out>/zoology.png and <out>/zoology.md, for this call's widths and
variants. Train flags beyond these keys come from config/compare/mqar.py (2 layers, 4 heads,
rotary, Muon).

Every mistake is one line before anything is prepared or trained, in this script's keys: each key,
and what compare.py and train.py would refuse of each variant at each width. --out is taken only
when new, empty or made by this script (its zoology.json, which records the call's settings: a later
call into it must train on the same data with the same budget and rates, and may add pair counts,
widths, variants or seeds). A dataset in --data is reused only when the settings its meta.json
records are those this call would prepare it with; else the script names the differences.
"""

import csv
import dataclasses
import json
import re
import runpy
import sys
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path

from configurator import parse_config, run_cli, split_args
from smallgpt import sweep
from smallgpt.atomic import atomic_open, check_claimable, check_writes_into, claim_folder
from smallgpt.configs import CompareConfig, TrainConfig, rate_label, repeated, variant_problems
from smallgpt.data import load_meta
from smallgpt.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
PREPARE = "data/mqar/prepare.py"
KIND = "a Zoology figure"  # smallgpt/atomic.py's kind: zoology.json marks the out folder
# What decides a comparison's runs (their data, budget and rates): a later call into the same out
# folder gives the same, or its runs would resume or sit beside runs of another kind
RUN_KEYS = ("seq_len", "key_vocab", "value_vocab", "train_examples", "max_iters", "lrs")
# The prepare script's keys that this script names otherwise
OUR_NAMES = {"num_pairs": "pairs"}


@cache
def prepare_config() -> type:
    """data/mqar/prepare.py's PrepareConfig, from the script itself (a script may take another's
    config dataclass; data/ is no package to import it from): its keys and its checks."""
    return runpy.run_path(str(ROOT / PREPARE), run_name="mqar_prepare")["PrepareConfig"]


def in_our_keys(text: str) -> str:
    """text with the prepare script's key names replaced by this script's (OUR_NAMES)."""
    for theirs, ours in OUR_NAMES.items():
        text = re.sub(rf"\b{theirs}\b", ours, text)
    return text


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
        problems = self.count_problems()
        problems += variant_problems(self.variants)  # before any dataset is prepared
        listed = {
            "pairs": self.pairs,
            "widths": self.widths,
            "variants": self.variants,
            "lrs": [rate_label(lr) for lr in self.lrs],  # as compare.py names its runs
        }
        for key, items in listed.items():
            again = repeated(items)
            if again is not None:
                problems.append(f"{key}={getattr(self, key)} lists {again} twice: list it once")
        if problems:
            raise ValueError("; ".join(problems))
        # each dataset's settings, checked as the prepare script checks them
        for pairs in self.pairs:
            self.dataset_settings(pairs)

    def count_problems(self) -> list[str]:
        """The sizes and counts that must be positive, the lists that must not be empty, the
        examples that must hold their pairs."""
        problems = []
        for key in ("pairs", "widths"):
            items = getattr(self, key)
            if not items or min(items) < 1:
                problems.append(f"{key}={items}: give positive sizes")
        positive = ("n_layer", "seq_len", "seeds", "max_iters", "speed_repeats", "decode_context")
        for key in positive:
            if getattr(self, key) < 1:
                problems.append(f"{key}={getattr(self, key)} must be positive")
        if min(self.lrs, default=1) <= 0:
            problems.append(f"lrs={self.lrs}: learning rates must be positive")
        for key in ("out", "data"):
            if not getattr(self, key):
                problems.append(f"{key}='' names no folder")
        # Zoology's layout: the pairs, then a query and its answer for each key
        most = max(self.pairs, default=0)
        if not problems and self.seq_len < 4 * most:
            problems.append(
                f"seq_len={self.seq_len} < 4*pairs = {4 * most} for pairs={most}: an example "
                f"holds the pairs, then a query and its answer for each key"
            )
        return problems

    def dataset_settings(self, pairs: int) -> dict:
        """The settings of the dataset of pairs pairs, as data/mqar/prepare.py resolves and
        records them (meta.json's 'settings': every key but out_dir); a ValueError in this
        script's keys where that script would refuse them."""
        try:
            made = prepare_config()(
                layout="zoology",
                num_pairs=pairs,
                seq_len=self.seq_len,
                key_vocab=self.key_vocab,
                value_vocab=self.value_vocab,
                train_examples=self.train_examples,
            )
        except ValueError as e:
            raise ValueError(in_our_keys(str(e))) from e
        return {k: v for k, v in asdict(made).items() if k != "out_dir"}


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


def dataset_folder(cfg: ZoologyConfig, pairs: int) -> Path:
    """Where the dataset of pairs pairs is prepared, or found."""
    return Path(cfg.data) / f"mqar-zoology-p{pairs}"


def differences(made: dict, wanted: dict, keys: tuple[str, ...]) -> str:
    """'a=1, b=2, not this call's a=3, b=4' for the keys whose values differ (named in this
    script's keys); '' where none does."""
    differ = [k for k in keys if made.get(k) != wanted.get(k)]
    if not differ:
        return ""
    was = ", ".join(f"{OUR_NAMES.get(k, k)}={made.get(k)}" for k in differ)
    now = ", ".join(f"{OUR_NAMES.get(k, k)}={wanted.get(k)}" for k in differ)
    return f"{was}, not this call's {now}"


def recorded(settings: object) -> dict | None:
    """A marker's or a meta's recorded settings, None where there are none (or not a table)."""
    return settings if isinstance(settings, dict) else None


def to_prepare(cfg: ZoologyConfig, pairs: int) -> bool:
    """Whether the dataset of pairs pairs is to be prepared (False: it is there, prepared with
    this call's settings); a UserError, before any work, where its folder holds a dataset of other
    settings (or of none recorded) or files a preparation would replace."""
    folder = dataset_folder(cfg, pairs)
    wanted = cfg.dataset_settings(pairs)
    for path in (Path(cfg.data), folder):
        if path.exists() and not path.is_dir():
            raise UserError(f"{path} is a file, not a folder: give --data=<another folder>")
    if not (folder / "meta.json").is_file():
        # as the prepare script's writing_dataset decides it, but before any dataset is prepared
        splits = ("train", "val", "test")
        files = tuple(f"{s}{kind}.bin" for s in splits for kind in ("", "_mask"))
        check_writes_into(folder, "a dataset", (*files, "meta.json"))
        return True
    made = recorded(load_meta(folder).get("settings"))
    fix = "delete it, or give --data=<another folder>"
    if made is None:
        raise UserError(
            f"{folder} records no settings (prepared before datasets recorded them), so it may "
            f"not be this call's dataset: {fix}"
        )
    keys = tuple(dict.fromkeys([*wanted, *made]))  # this call's order, then any others
    if text := differences(made, wanted, keys):
        raise UserError(f"{folder} was prepared with {text}: {fix}")
    return False


def check_out(cfg: ZoologyConfig) -> None:
    """Before any work: --out is new, empty or this script's (check_claimable), and one made by
    an earlier call holds runs of this call's data, budget and rates (RUN_KEYS)."""
    out = Path(cfg.out)
    check_claimable(out, KIND)
    marker = out / "zoology.json"
    if not marker.is_file():
        return
    try:
        made = recorded(json.loads(marker.read_text()).get("settings"))
    except (json.JSONDecodeError, AttributeError):  # not JSON, or not a table
        made = None
    fix = "delete it, or give --out=<another folder>"
    if made is None:
        raise UserError(f"{marker} records no settings of the comparisons in {out}: {fix}")
    now = {k: getattr(cfg, k) for k in RUN_KEYS}
    if text := differences(made, now, RUN_KEYS):
        raise UserError(
            f"{out} holds comparisons made with {text}: their runs would resume or sit beside "
            f"this call's; {fix}"
        )


def compare_command(cfg: ZoologyConfig, pairs: int) -> list[str]:
    """compare.py's command line for the comparison of pairs pairs over the widths."""
    sizes = ",".join(f"{cfg.n_layer}x{w}" for w in cfg.widths)
    command = [
        "compare.py",
        str(ROOT / "config" / "compare" / "mqar.py"),
        f"--dataset={dataset_folder(cfg, pairs)}",
        f"--out_dir={Path(cfg.out) / f'p{pairs}'}",
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
    return command


def check_comparison(cfg: ZoologyConfig) -> None:
    """Before any work: compare.py's config and each run's train.py config (each variant at each
    width and rate), built from this call's command line as compare.py builds them (the pair count
    changes only the dataset), so that what they would refuse is said here, of widths and
    variants."""
    ours, train_args = split_args(compare_command(cfg, cfg.pairs[0])[1:], CompareConfig)
    try:
        compare = parse_config(CompareConfig, ours)
        base = parse_config(TrainConfig, train_args)
    except UserError as e:  # the script's keys are checked already: the config file's doing
        raise UserError(f"config/compare/mqar.py with this call's keys: {e}") from e
    # one seed: the seeds' runs differ in nothing those checks read
    compare = dataclasses.replace(compare, train_args=train_args, seeds=1)
    vocab_size = cfg.key_vocab + cfg.value_vocab
    for width in cfg.widths:
        size = f"{cfg.n_layer}x{width}"
        at = (
            f"width {width} (n_layer={cfg.n_layer}; config/compare/mqar.py's n_head={base.n_head}; "
            f"block_size = seq_len - 1 = {base.block_size})"
        )
        for name in cfg.variants or [""]:
            one = [name] if name else []
            sized = dataclasses.replace(compare, sizes=[size], variants=one)
            what = f"variants: {name} at {at}" if name else f"widths: {at}"
            try:
                runs = sweep.plan(sized, base, vocab_size, Path(cfg.out))
                for r in runs:
                    parse_config(TrainConfig, [*r.args, f"--out_dir={r.dir}"])
            except (UserError, ValueError) as e:
                raise UserError(f"{what}: {str(e).removeprefix(f'sizes: {size}: ')}") from e
            # compare.py names each run as what it is: gqa4 at 4 heads is mha
            if name and runs[0].name != name:
                canonical = runs[0].name
                raise UserError(
                    f"{what}: {name} is {canonical} at n_head={base.n_head}: name it {canonical}"
                )


def prepare(cfg: ZoologyConfig, pairs: int) -> None:
    """The MQAR dataset of pairs pairs in Zoology's layout, every setting given."""
    settings = cfg.dataset_settings(pairs)
    flags = [f"--{k}={v}" for k, v in settings.items()]
    run([PREPARE, f"--out_dir={dataset_folder(cfg, pairs)}", *flags])


def accuracies(folder: Path) -> dict[str, dict[int, tuple[float, str]]]:
    """A comparison's MQAR accuracy by variant and width: (pooled accuracy, 'k/n' solved). Its
    report.csv holds this call's widths and variants alone (compare.py reports the runs its
    command names, whatever else an earlier call trained there)."""
    out: dict[str, dict[int, tuple[float, str]]] = {}
    with open(folder / "report.csv") as f:
        for row in csv.DictReader(f):
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
    # whole or not at all, as every file the project keeps
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
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
    # every refusal before any work: the runs, the out folder, the datasets
    check_comparison(cfg)
    check_out(cfg)
    fresh = [pairs for pairs in cfg.pairs if to_prepare(cfg, pairs)]
    out = Path(cfg.out)
    claim_folder(out, KIND, {"command": sys.argv, "settings": asdict(cfg)})
    by_pairs = {}
    for pairs in cfg.pairs:
        if pairs in fresh:
            prepare(cfg, pairs)
        run(compare_command(cfg, pairs))
        by_pairs[pairs] = accuracies(out / f"p{pairs}")
    figure(by_pairs, out / "zoology.png")
    text = table(by_pairs)
    with atomic_open(out / "zoology.md", "w") as f:
        f.write(text)
    print(f"{text}\nwrote {out / 'zoology.png'}, {out / 'zoology.md'}")


if __name__ == "__main__":
    run_cli(main, ZoologyConfig)
