"""openwebtext: OpenWebText (8M documents, ~9B GPT-2 tokens) for reproducing GPT-2 124M, as nanoGPT.

Downloads through Hugging Face datasets (about 55 GB of cache; --streaming=True needs no cache) and tokenises with
GPT-2's BPE. With no network, --input takes local parquet/json/text files. Usage:
    python data/openwebtext/prepare.py [--num_proc=8] [--streaming=True] [--input=PATH] [--max_docs=N]
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
    streaming: bool = False  # read the hub dataset as a stream: little disk, one process
    val_every: int = 2000  # every N-th document goes to val (0.05%, as nanoGPT)
    max_docs: int | None = None


def main(cfg: PrepareConfig) -> None:
    ds = load_corpus("Skylion007/openwebtext", None, cfg.input, cfg.streaming)
    prepare_corpus(ds, Path(cfg.out_dir), cfg.num_proc, cfg.val_every, cfg.max_docs)


if __name__ == "__main__":
    run_cli(main, PrepareConfig)
