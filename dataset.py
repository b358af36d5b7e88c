"""Turn any local UTF-8 text file into a dataset (smallgpt/data.py's layout: train.bin, val.bin,
meta.json):

    python dataset.py --input=notes.txt --out_dir=data/notes --tokenizer=char

or --tokenizer=gpt2, or --tokenizer=bpe --vocab_size=N.
"""

# configurator first: a Ctrl-C while torch imports is then one line, not a traceback
from configurator import run_cli
from smallgpt.errors import UserError

# isort: split
from dataclasses import dataclass
from pathlib import Path

from smallgpt.data import prepare_text, read_text, settings_of


@dataclass(slots=True)
class TextConfig:
    input: str = ""  # a UTF-8 text file
    out_dir: str = ""  # the dataset folder to write, e.g. data/mytext
    tokenizer: str = "char"  # 'char', 'gpt2', or 'bpe' (a byte-level BPE trained on the input)
    vocab_size: int | None = None  # bpe: tokens to train, bytes and <|endoftext|> included
    val_fraction: float = 0.05  # the held-out tail: val, then test (a tenth in all, as nanoGPT)
    test_fraction: float = 0.05  # 0: no test split


def main(cfg: TextConfig) -> None:
    if not cfg.input or not cfg.out_dir:
        raise UserError(
            "usage: python dataset.py --input=FILE --out_dir=data/NAME [--tokenizer=char|gpt2|bpe "
            "--vocab_size=N]"
        )
    prepare_text(
        read_text(cfg.input),
        Path(cfg.out_dir),
        cfg.tokenizer,
        cfg.val_fraction,
        cfg.vocab_size,
        cfg.test_fraction,
        settings_of(cfg),
    )


if __name__ == "__main__":
    run_cli(main, TextConfig)
