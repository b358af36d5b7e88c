"""fineweb_edu: a FineWeb-Edu sample (sample-10BT: ~10B GPT-2 tokens of educational web pages).

Streams from the Hugging Face hub by default (little disk; --streaming=False caches it first and tokenises with
num_proc processes), GPT-2's BPE. With no network, --input takes local parquet/json/text files. Usage:
    python data/fineweb_edu/prepare.py [--max_docs=1000000] [--subset=sample-100BT] [--input=PATH]
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
    streaming: bool = True
    subset: str | None = "sample-10BT"  # sample-10BT, sample-100BT or sample-350BT


if __name__ == "__main__":
    run_cli(lambda cfg: prepare_hub_corpus(cfg, "HuggingFaceFW/fineweb-edu"), PrepareConfig)
