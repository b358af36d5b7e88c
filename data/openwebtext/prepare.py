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
from corpus import CorpusConfig, prepare_hub_corpus  # noqa: E402


@dataclass(slots=True)
class PrepareConfig(CorpusConfig):
    out_dir: str = str(Path(__file__).resolve().parent)


if __name__ == "__main__":
    run_cli(lambda cfg: prepare_hub_corpus(cfg, "Skylion007/openwebtext"), PrepareConfig)
