"""openwebtext: OpenWebText (8M documents, ~9B GPT-2 tokens) for reproducing GPT-2 124M, as nanoGPT.

Downloads through Hugging Face datasets (about 55 GB of cache; --streaming=True needs no cache) and
tokenises with GPT-2's BPE. With no network, --input takes local parquet/json/text files. Usage:
    python data/openwebtext/prepare.py [--num_proc=8] [--streaming=True] [--input=PATH]
        [--max_docs=N]
"""

from dataclasses import dataclass
from pathlib import Path

from configurator import run_cli
from smallgpt.corpus import CorpusConfig, prepare_hub_corpus


@dataclass(slots=True)
class PrepareConfig(CorpusConfig):
    out_dir: str = str(Path(__file__).resolve().parent)


if __name__ == "__main__":
    run_cli(lambda cfg: prepare_hub_corpus(cfg, "Skylion007/openwebtext"), PrepareConfig)
