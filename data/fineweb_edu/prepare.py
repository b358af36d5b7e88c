"""fineweb_edu: a FineWeb-Edu sample (sample-10BT: ~10B GPT-2 tokens of educational web pages).

Streams from the Hugging Face hub by default (little disk; --streaming=False caches it first and
tokenises with num_proc processes), GPT-2's BPE. With no network, --input takes local
parquet/json/text files. Usage:
    python data/fineweb_edu/prepare.py [--max_docs=1000000] [--subset=sample-100BT] [--input=PATH]
"""

from dataclasses import dataclass
from pathlib import Path

from configurator import run_cli
from smallgpt.corpus import CorpusConfig, prepare_hub_corpus


@dataclass(slots=True)
class PrepareConfig(CorpusConfig):
    out_dir: str = str(Path(__file__).resolve().parent)
    streaming: bool = True
    subset: str | None = "sample-10BT"  # sample-10BT, sample-100BT or sample-350BT


if __name__ == "__main__":
    run_cli(lambda cfg: prepare_hub_corpus(cfg, "HuggingFaceFW/fineweb-edu"), PrepareConfig)
