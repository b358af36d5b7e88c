"""Measure what attention recalls: `python eval.py --out_dir=out-pycode-char` (or --init_from=hf:<folder>).

Tasks (recall.py): induction (a random segment copied at several distances: loss and top-1 accuracy on the copy),
position (the val loss at each context position), mqar (exact-match recall on an MQAR dataset, data/mqar). Seeded:
the same model gives the same numbers. One JSON line per measure at the end, as bench.py prints.
"""

# configurator first: a Ctrl-C while torch imports is then one line, not a traceback
from configurator import run_cli
from errors import UserError

# isort: split
import json
from dataclasses import dataclass, field

import recall
import runtime
from checkpoint import load_run, parse_source
from dataset import Batches, data_dir


@dataclass(slots=True)
class EvalConfig:
    init_from: str = "resume"  # 'resume' (out_dir/ckpt.pt), 'gpt2' ... 'gpt2-xl', or 'hf:<folder>'
    out_dir: str = "out"
    tasks: list[str] = field(default_factory=lambda: ["induction", "position"])  # of induction, position, mqar
    dataset: str = ""  # position and mqar read its val split; empty: the run's own dataset
    distances: list[int] = field(default_factory=list)  # induction's; empty: doubling up to block_size
    induction_length: int = 16  # tokens in the copied segment
    examples: int = 256  # induction sequences per distance
    eval_iters: int = 50  # position and mqar: val batches of batch_size, the ones train.py evaluates on
    batch_size: int = 32
    seed: int = 0
    device: str = "auto"
    dtype: str = "float32"  # float32, bfloat16, or auto (as train.py decides)
    progress: bool = True  # progress bars on stderr

    def __post_init__(self) -> None:
        problems = []
        for key in ("induction_length", "examples", "eval_iters", "batch_size"):
            if getattr(self, key) < 1:
                problems.append(f"{key}={getattr(self, key)} must be positive")
        if not self.tasks:
            problems.append("tasks=[] names no task: give some of " + ", ".join(recall.TASKS))
        problems += recall.task_problems("tasks", self.tasks)
        if self.seed < 0:
            problems.append(f"seed={self.seed} must not be negative")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            problems.append(f"dtype={self.dtype!r} must be auto, float32 or bfloat16")
        if problems:
            raise ValueError("; ".join(problems))


def main(cfg: EvalConfig) -> None:
    source = parse_source(cfg.init_from)
    if source.kind not in ("resume", "gpt2", "hf"):
        raise UserError(f"init_from={cfg.init_from!r}: eval.py reads a run (resume) or pretrained weights (gpt2*, "
                        f"hf:<folder>)")
    run = load_run(source, cfg.out_dir, "cpu")
    model, tok = run.model, run.tokenizer
    place = runtime.place(cfg.device, cfg.dtype, model.config.n_embd)
    model = model.to(place.device)
    dataset = cfg.dataset or run.config.get("dataset", "")
    reads_data = [t for t in cfg.tasks if t in ("position", "mqar")]
    if reads_data and not dataset:
        raise UserError(f"tasks {', '.join(reads_data)} read a dataset's val split and {cfg.init_from} names none: "
                        f"give --dataset=...")

    batches = None
    if reads_data:
        seed = run.config.get("seed", 1337)  # the run's: its evaluation batches
        batches = Batches(data_dir(dataset), model.config.block_size, cfg.batch_size, seed, place.device)
    vocab = min(tok.n_vocab, model.config.vocab_size)  # GPT-2's embedding rows past its 50257 tokens are padding
    results = recall.run_tasks(cfg.tasks, model, batches, cfg.eval_iters, vocab, cfg.distances or None,
                               cfg.induction_length, cfg.examples, cfg.batch_size, cfg.seed, place.autocast(),
                               cfg.progress)
    for row in measures(results):
        print(json.dumps(row))


def measures(results: dict) -> list[dict]:
    """recall.run_tasks's results as one flat record per measure."""
    rows = [{"task": "induction", **r} for r in results.get("induction", [])]
    if "position" in results:
        rows.append({"task": "position", "loss": results["position"]})
    if "mqar" in results:
        rows.append({"task": "mqar", **results["mqar"]})
    return rows


if __name__ == "__main__":
    run_cli(main, EvalConfig)
