"""fineweb_edu: a FineWeb-Edu sample (sample-10BT: ~10B GPT-2 tokens of educational web pages).

Streams from the Hugging Face hub by default (little disk; --streaming=False caches it first and tokenises with
num_proc processes), GPT-2's BPE. With no network, --input takes local parquet/json/text files. Usage:
    python data/fineweb_edu/prepare.py [--max_docs=1000000] [--streaming=False --num_proc=8] [--input=PATH]
"""

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for dataset.py and configurator.py

from configurator import run_cli  # noqa: E402
from dataset import load_corpus, prepare_corpus  # noqa: E402


@dataclass(slots=True)
class PrepareConfig:
    input: str | None = None  # local parquet/json/text files (a path or glob) instead of the hub
    out_dir: str = str(Path(__file__).resolve().parent)
    num_proc: int = 8  # tokenising processes (not used when streaming)
    streaming: bool = True  # read the hub dataset as a stream: little disk, one process
    val_every: int = 2000  # every N-th document goes to val (0.05%, as nanoGPT)
    max_docs: int | None = None
    sample: str = "sample-10BT"  # the hub configuration: sample-10BT, sample-100BT, sample-350BT


def main(cfg: PrepareConfig) -> None:
    ds = load_corpus("HuggingFaceFW/fineweb-edu", cfg.sample, cfg.input, cfg.streaming)
    prepare_corpus(ds, Path(cfg.out_dir), cfg.num_proc, cfg.val_every, cfg.max_docs)


if __name__ == "__main__":
    run_cli(main, PrepareConfig)
