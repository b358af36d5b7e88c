import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo's flat modules: model, train, ...

from model import GPT, GPTConfig  # noqa: E402

VARIANTS = {"MHA": 4, "GQA": 2, "MQA": 1}  # n_kv_head for n_head=4


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1337)


def tiny_model(n_kv_head: int | None = None, pos_encoding: str = "learned", **overrides: object) -> GPT:
    """A 2-layer, 32-wide model in eval mode, fp32 on CPU."""
    cfg = dict(block_size=32, vocab_size=61, n_layer=2, n_head=4, n_kv_head=n_kv_head, n_embd=32, dropout=0.0,
               bias=True, pos_encoding=pos_encoding) | overrides
    return GPT(GPTConfig(**cfg)).eval()


ROOT = Path(__file__).resolve().parent.parent
TINY_TRAIN = ["--n_layer=2", "--n_head=4", "--n_embd=32", "--block_size=32", "--batch_size=8", "--eval_iters=4",
              "--log_interval=10", "--learning_rate=3e-3", "--warmup_iters=5", "--device=cpu", "--dtype=float32"]


def run(args: list[str], env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run a python command in the repo root; fail with its output if it fails."""
    r = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **(env or {})})
    assert r.returncode == 0, f"{args} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="session")
def pycode_small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real pycode_char prepare script, cut to its first 300k characters."""
    out = tmp_path_factory.mktemp("pycode_small")
    run(["data/pycode_char/prepare.py", f"--out_dir={out}", "--max_chars=300000"])
    return out


def read_log(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "log.jsonl").read_text().splitlines()]
