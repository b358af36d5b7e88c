"""shakespeare_char: tiny shakespeare (1 MB) as a character-level dataset, as in nanoGPT.

Downloads the text when online; with no network, pass a local copy: --input=path/to/input.txt.
Usage: python data/shakespeare_char/prepare.py [--input=FILE] [--out_dir=data/shakespeare_char]
"""

from dataclasses import dataclass
from pathlib import Path

from configurator import run_cli
from smallgpt.data import download_text, prepare_text, read_text, settings_of

URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"


@dataclass(slots=True)
class PrepareConfig:
    input: str | None = None  # a local copy of the text; None downloads it from url
    url: str = URL
    out_dir: str = str(Path(__file__).resolve().parent)
    val_fraction: float = 0.05  # the held-out tail: val, then test (a tenth in all, as nanoGPT)
    test_fraction: float = 0.05  # 0: no test split
    tokenizer: str = "char"  # data/shakespeare/prepare.py runs this with 'gpt2'


def main(cfg: PrepareConfig) -> None:
    text = read_text(cfg.input) if cfg.input else download_text(cfg.url)
    prepare_text(
        text,
        Path(cfg.out_dir),
        cfg.tokenizer,
        cfg.val_fraction,
        test_fraction=cfg.test_fraction,
        settings=settings_of(cfg),
    )


if __name__ == "__main__":
    run_cli(main, PrepareConfig)
