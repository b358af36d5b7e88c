"""pycode_char: a character-level dataset from the Python standard library's own source, needing no
network.

Files come from the running interpreter's stdlib (test folders and site-packages left out) in sorted
order, so the result is the same bytes on every run with the same Python version. 90/5/5
train/val/test split (nanoGPT's 90/10, its held-out tenth in two halves).
Usage: python data/pycode_char/prepare.py [--out_dir=data/pycode_char] [--max_chars=N]
"""

import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from configurator import run_cli  # first: a Ctrl-C while the libraries import is then one line

# isort: split
from tqdm import tqdm

from smallgpt.data import settings_of, split_ids, write_dataset
from smallgpt.tokenizer import CharTokenizer

SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass(slots=True)
class PrepareConfig:
    out_dir: str = str(Path(__file__).resolve().parent)
    val_fraction: float = 0.05  # the held-out tail: val, then test (a tenth in all, as nanoGPT)
    test_fraction: float = 0.05  # 0: no test split
    max_chars: int | None = (
        None  # keep only the first N characters (for quick experiments and tests)
    )

    def __post_init__(self) -> None:
        if self.max_chars is not None and self.max_chars < 2:
            raise ValueError(f"max_chars={self.max_chars} must be at least 2 (or None: all)")


def stdlib_files(root: Path) -> list[Path]:
    return sorted(
        (p for p in root.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(root).parts[:-1])),
        key=lambda p: p.relative_to(root).as_posix(),
    )


def main(cfg: PrepareConfig) -> None:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files(root)
    if not files:
        raise FileNotFoundError(
            f"no Python source files under {root}: this interpreter ships no stdlib sources"
        )
    parts = []
    for path in tqdm(files, desc=f"reading {root}", unit="file"):
        parts.append(
            f"# {path.relative_to(root).as_posix()}\n"
            f"{path.read_text(encoding='utf-8', errors='replace')}\n"
        )
    text = "".join(parts)[: cfg.max_chars]
    tok = CharTokenizer.from_text(text)
    meta = tok.meta() | {"source": f"Python {sys.version.split()[0]} stdlib, {len(files)} files"}
    train, val, test = split_ids(tok.encode_array(text), cfg.val_fraction, cfg.test_fraction)
    write_dataset(Path(cfg.out_dir), train, val, meta, test, settings_of(cfg))


if __name__ == "__main__":
    run_cli(main, PrepareConfig)
