"""Checkpoints written by the code at 700a4ab (tests/fixtures/compat, made by
tests/fixtures/make_compat_checkpoints.py) still load, sample, resume and export as they did then.

Each fixture is a real run folder of train.py (ckpt.pt with its AdamW state, log.jsonl, config.json)
on a tiny char-level dataset (compat/dataset), one per model: GQA with a local layer and Qwen3.5's
gate and q/k norms, MLA, and Gated DeltaNet with global attention; together every layer kind and
every cache kind. Beside each, expected.json holds what the code of that commit computed from it:
the oracle a refactor of model.py, attention.py and gated_deltanet.py must still meet. The tests
copy a fixture into tmp_path first, and never write into tests/fixtures.
"""

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from conftest import cli, one_thread, read_log, run
from smallgpt import generation
from smallgpt.checkpoint import Source, load_checkpoint, load_run, model_from_checkpoint

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "compat"
# every fixture, named: one missing fails its tests rather than leaving them out
NAMES = ("gqa_local", "mla", "hybrid_dl")
# the bound on a logit or loss computed again from the same weights (float32, on any thread count)
ATOL = 1e-5
# the bound on transformers' logits of an export against ours (test_export's)
HF_ATOL = 1e-4


@dataclass
class OldRun:
    """A copy of one fixture run and of the dataset it was trained on, with its expected.json."""

    out: Path
    dataset: Path
    expected: dict
    chars: list[str]

    def ids(self, text: str) -> list[int]:
        """text's token ids, by the dataset's characters."""
        return [self.chars.index(c) for c in text]


@pytest.fixture(params=NAMES)
def old_run(request: pytest.FixtureRequest, tmp_path: Path) -> OldRun:
    """One fixture run and its dataset, copied into tmp_path."""
    name = request.param
    dataset = shutil.copytree(FIXTURES / "dataset", tmp_path / "dataset")
    out = shutil.copytree(FIXTURES / name, tmp_path / name)
    expected = json.loads((out / "expected.json").read_text())
    chars = json.loads((dataset / "meta.json").read_text())["chars"]
    return OldRun(out, dataset, expected, chars)


def forward(model: torch.nn.Module, old: OldRun) -> tuple[torch.Tensor, float]:
    """The model's first logits at the last position and its loss for the fixed input recorded."""
    recorded = old.expected["forward"]
    ids = torch.tensor([old.ids(recorded["input"])])
    with torch.no_grad():
        logits, loss = model.eval()(ids[:, :-1], targets=ids[:, 1:])
    return logits[0, -1, : len(recorded["last_logits"])], loss.item()


def test_an_old_checkpoint_loads_with_its_weights_config_and_logits(old_run: OldRun) -> None:
    """The load path every script takes (load_run) builds the stored model: the same state_dict
    keys and tensors, each stored model_config key as stored, and the logits recorded then."""
    ckpt = load_checkpoint(old_run.out / "ckpt.pt")
    stored = ckpt["model_config"]
    for model in (model_from_checkpoint(ckpt), load_run(Source("resume"), old_run.out).model):
        state = model.state_dict()
        assert sorted(state) == sorted(ckpt["model"])  # the names; their order is the modules'
        for key, tensor in ckpt["model"].items():
            assert torch.equal(state[key], tensor), key
        # keys the refactor adds to GPTConfig may be there too, at values that change nothing
        assert {key: getattr(model.config, key) for key in stored} == stored
        logits, loss = forward(model, old_run)
        recorded = old_run.expected["forward"]
        torch.testing.assert_close(logits, torch.tensor(recorded["last_logits"]), rtol=0, atol=ATOL)
        assert loss == pytest.approx(recorded["loss"], rel=0, abs=ATOL)
    assert ckpt["iter_num"] == old_run.expected["resume"]["iter_num"] - 2  # the run it resumes


def test_sample_py_decodes_the_old_greedy_tokens(
    old_run: OldRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sample.py's greedy continuation, through each kind's cache and past block_size (the context
    slides, and is prefilled again), is the one recorded then, token for token, and so are the
    first logits of each step (what a change too small to turn a greedy token shows in)."""
    recorded = old_run.expected["sample"]
    n_logits = len(recorded["step_logits"][0])
    steps = []
    draw = generation.sample_logits

    def recording(logits: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        """sample_logits, recording the logits it draws each step's token from (B, vocab)."""
        steps.append(logits[0, :n_logits].tolist())
        return draw(logits, *args, **kwargs)

    # the decoding looks it up in its module at each step, as the fixture's recording did
    monkeypatch.setattr(generation, "sample_logits", recording)
    with one_thread():
        r = run(
            [
                "sample.py",
                f"--out_dir={old_run.out}",
                f"--start={recorded['prompt']}",
                f"--max_new_tokens={recorded['max_new_tokens']}",
                "--temperature=0",
                "--device=cpu",
                "--dtype=float32",  # auto picks bf16 on a CPU with native bf16
            ]
        )
    text = r.stdout[:-1]  # a single sample ends with a newline
    assert old_run.ids(text) == recorded["ids"], f"{text!r} != {recorded['text']!r}"
    torch.testing.assert_close(
        torch.tensor(steps), torch.tensor(recorded["step_logits"]), rtol=0, atol=ATOL
    )


def test_train_py_resumes_an_old_run_to_the_old_losses(old_run: OldRun) -> None:
    """train.py resumes the old run (its optimizer state, RNG states and run config) for 2
    iterations: it logs the losses recorded then and saves at the new iteration."""
    recorded = old_run.expected["resume"]
    with one_thread():  # as the fixture's resume ran (OMP_NUM_THREADS=1)
        run(
            [
                "train.py",
                f"--out_dir={old_run.out}",
                f"--dataset={old_run.dataset}",  # the run config holds the fixture's own path
                *recorded["args"],
            ]
        )
    assert load_checkpoint(old_run.out / "ckpt.pt")["iter_num"] == recorded["iter_num"]
    log = read_log(old_run.out)
    resumed = log[max(i for i, r in enumerate(log) if r["event"] == "config") :]
    trains = {str(r["iter"]): r["loss"] for r in resumed if r["event"] == "train"}
    val = [r["val_loss"] for r in resumed if r["event"] == "eval"][-1]
    assert all(math.isfinite(loss) for loss in [*trains.values(), val])
    assert trains == pytest.approx(recorded["train_loss"], rel=0, abs=ATOL)
    assert val == pytest.approx(recorded["val_loss"], rel=0, abs=ATOL)


def test_export_py_exports_an_old_run_or_refuses_it_as_before(
    old_run: OldRun, tmp_path: Path
) -> None:
    """export.py writes the transformers class it wrote then, whose logits are the ones recorded;
    a model it refused then is refused in one line for the same reason, nothing written."""
    recorded = old_run.expected["export"]
    dest = tmp_path / "hf"
    r = cli(["export.py", f"--out_dir={old_run.out}", f"--to={dest}"])
    if "refused" in recorded:
        assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
        assert r.stderr.startswith("error: export needs ") and recorded["because"] in r.stderr
        assert not dest.exists()
        return
    assert r.returncode == 0, r.stderr
    assert f"wrote {dest}: {recorded['class']}" in r.stdout
    from transformers import AutoModelForCausalLM  # here: only the tests that export need it

    hf = AutoModelForCausalLM.from_pretrained(dest).eval()
    assert type(hf).__name__ == recorded["class"]
    ids = torch.tensor([old_run.ids(old_run.expected["forward"]["input"])])
    want = torch.tensor(old_run.expected["forward"]["last_logits"])
    with torch.no_grad():
        logits = hf(ids[:, :-1]).logits[0, -1, : len(want)]
    torch.testing.assert_close(logits, want, rtol=0, atol=HF_ATOL)
