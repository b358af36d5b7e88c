"""shakespeare: tiny shakespeare tokenised with GPT-2's BPE (tiktoken), for fine-tuning GPT-2 as in
nanoGPT.

Usage: python data/shakespeare/prepare.py [--input=FILE]
(the options of data/shakespeare_char/prepare.py)
"""

import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    sys.argv[1:1] = [f"--out_dir={here}", "--tokenizer=gpt2"]  # later flags still override these
    runpy.run_path(str(here.parent / "shakespeare_char" / "prepare.py"), run_name="__main__")
