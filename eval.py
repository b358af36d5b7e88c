"""Measure what attention recalls: `python eval.py --out_dir=out-pycode-char` (or
--init_from=hf:<folder>).

Tasks (smallgpt/recall.py): induction (a random segment copied at several distances: loss and top-1
accuracy on the copy), position (the val loss at each context position), mqar (exact-match recall
on an MQAR dataset, data/mqar); and past the trained length, in an MQAR dataset's tokens
(smallgpt/long_recall.py): needle (a key and --needle_tokens value tokens at each of --depths in
filler, asked for at the end) and mqar_long (MQAR with more filler), at each of --lengths (1x to 8x
block_size by default), solved k/n per cell with its Clopper-Pearson interval. Seeded: the same
model gives the same numbers. A key left out is the run's, as its train.py --final_evals used it
(tasks, batch_size, eval_iters, seed, dtype, the induction segment), so `python eval.py
--out_dir=RUN` prints the numbers in the run's log.jsonl (on the device it trained on): position
and mqar read the dataset's test split where it has one, as train.py's final evaluation does
(--split=val for the other). --dataset must be in the model's own tokens. One JSON line per
measure at the end, as bench.py prints. --zero_mixers=[3] measures the model with layer 3's token
mixer (its attention, or its recurrent layer) giving zeros: which layers a recall needs.

Standard benchmarks (smallgpt/harness.py, docs/benchmarks.md): --lm_eval=[hellaswag,arc_easy,...]
scores the model with lm-evaluation-harness (an optional dependency) through a temporary
transformers folder, each log-likelihood checked against this project's scorer; lines and
next_line are the project's own tasks, made from the dataset's held-out text, offline. A run's
scores also go to its log.jsonl and wandb summary.
"""

# configurator first: a Ctrl-C while torch imports is then one line, not a traceback
from configurator import run_cli
from smallgpt.errors import UserError

# isort: split
import contextlib
import dataclasses
import functools
import json
import tempfile
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from smallgpt import checkpoint, choice_task, harness, recall, runlog, runtime
from smallgpt.checkpoint import Run, Source, load_run, parse_source
from smallgpt.configs import repeat_problems
from smallgpt.data import Batches, data_dir, load_meta, splits_of
from smallgpt.tokenizer import encode_prompt

DTYPES = ("auto", "float32", "bfloat16", "float16")
# The keys each task reads (recall.run_tasks): one given that no task of the command reads would
# change nothing, so it is refused (check_read)
TASK_KEYS = {
    "induction": ("distances", "induction_length", "examples", "batch_size", "seed"),
    "position": ("dataset", "split", "eval_iters", "batch_size"),
    "mqar": ("dataset", "split", "eval_iters", "batch_size"),
    "needle": ("dataset", "lengths", "depths", "needle_tokens", "examples", "batch_size", "seed"),
    "mqar_long": ("dataset", "lengths", "examples", "batch_size", "seed"),
}
# ... and those the project's own harness tasks read (lines, next_line: examples items, seeded)
LINES_KEYS = ("dataset", "examples", "batch_size", "seed")
# ... and those that only the harness reads: without lm_eval, refused too (__post_init__)
HARNESS_KEYS = ("lm_eval_limit", "lm_eval_check")
# the recall tasks that read a dataset's split (induction makes its own sequences)
DATA_TASKS = ("position", *recall.MQAR_TASKS)


@dataclass(slots=True)
class EvalConfig:
    init_from: str = "resume"  # 'resume' (out_dir/ckpt.pt), 'gpt2' ... 'gpt2-xl', or 'hf:<folder>'
    out_dir: str = "out"
    # None below: the run's own value (what its --final_evals used), else the one after it
    tasks: list[str] | None = None  # of induction, position, mqar: its final_evals, else the 1st 2
    dataset: str = ""  # position and mqar read its split; empty: the run's own dataset
    split: str = "held_out"  # position and mqar's: val, test, or held_out (test if there, else val)
    distances: list[int] = field(default_factory=list)  # induction's; empty: doubling to block_size
    induction_length: int | None = None  # the copied segment's tokens; 16, or block_size // 4
    examples: int = 256  # induction sequences per distance, as train.py's --final_evals
    eval_iters: int | None = None  # position, mqar: val batches of batch_size, train.py's; else 50
    batch_size: int | None = None  # else 32
    seed: int | None = None  # induction's sequences (the val batches are the run's seed's); else 0
    # needle's and mqar_long's: context lengths (empty: 1x, 2x, 4x, 8x block_size), the needle's
    # depths (empty: 0, 0.25, 0.5, 0.75, 1; 0 the first token, 1 just before the question), and
    # the value tokens after its key (more than 1: a passkey)
    lengths: list[int] = field(default_factory=list)
    depths: list[float] = field(default_factory=list)
    needle_tokens: int = 1
    # lm-evaluation-harness (smallgpt/harness.py, an optional dependency): its task, group or tag
    # names (hellaswag, arc_easy, ...) or the project's own made from the dataset's held-out text
    # (lines, next_line: examples items, seeded); the model goes to a temporary transformers folder
    lm_eval: list[str] = field(default_factory=list)
    lm_eval_limit: int | None = None  # items per harness task (its --limit); None: all
    lm_eval_check: bool = True  # score each harness request again with this project's scorer
    device: str = "auto"
    dtype: str | None = None  # float32, bfloat16, float16 or auto (train.py's choice); else float32
    progress: bool = True  # progress bars on stderr
    # these layers' token mixers (attention or recurrent, 0-based) output zeros, the MLPs kept:
    # which layers a recall needs (docs/compare.md's KDA hybrid, whose attention went unused)
    zero_mixers: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        problems = []
        keys = ("induction_length", "examples", "eval_iters", "batch_size", "needle_tokens")
        for key in (*keys, "lm_eval_limit"):
            value = getattr(self, key)
            if value is not None and value < 1:
                problems.append(f"{key}={value} must be positive")
        if self.tasks == [] and not self.lm_eval:
            problems.append(
                "tasks=[] names no task: give some of " + ", ".join(recall.TASKS) + ", or lm_eval"
            )
        problems += self.harness_key_problems()
        problems += recall.task_problems("tasks", self.tasks or [])
        # a task or a distance named twice is measured once
        problems += repeat_problems("tasks", self.tasks or [])
        problems += repeat_problems("distances", self.distances)
        problems += repeat_problems("lengths", self.lengths)
        problems += repeat_problems("depths", self.depths)
        problems += repeat_problems("lm_eval", self.lm_eval)
        problems += repeat_problems("zero_mixers", self.zero_mixers)
        problems += [f"zero_mixers: {i} must not be negative" for i in self.zero_mixers if i < 0]
        if self.zero_mixers and self.lm_eval:
            # the harness scores a transformers copy of the model, which keeps every mixer
            problems.append(
                f"zero_mixers={self.zero_mixers} with lm_eval={self.lm_eval}: the harness scores "
                "a transformers copy of the whole model; leave one of them out"
            )
        problems += [f"lengths: {n} must be positive" for n in self.lengths if n < 1]
        problems += [f"depths: {d} must be between 0 and 1" for d in self.depths if not 0 <= d <= 1]
        if self.seed is not None and self.seed < 0:
            problems.append(f"seed={self.seed} must not be negative")
        if self.split not in ("val", "test", "held_out"):
            problems.append(f"split={self.split!r} must be val, test or held_out")
        if self.dtype is not None and self.dtype not in DTYPES:
            problems.append(f"dtype={self.dtype!r} must be one of {', '.join(DTYPES)}")
        if problems:
            raise ValueError("; ".join(problems))

    def harness_key_problems(self) -> list[str]:
        """A key that only lm_eval's tasks read (HARNESS_KEYS), given without lm_eval: it would
        change nothing."""
        if self.lm_eval:
            return []
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        problems = []
        for key in HARNESS_KEYS:
            value = getattr(self, key)
            if value != defaults[key]:
                problems.append(
                    f"{key}={value!r} is read by lm_eval's tasks, and lm_eval=[] names none: "
                    f"leave {key} out, or give --lm_eval=[<task>,...]"
                )
        return problems


def with_run_defaults(cfg: EvalConfig, run_config: dict) -> EvalConfig:
    """cfg with each key left out (None) as the run's config has it ({} for pretrained weights: the
    fallbacks), which is what train.py's --final_evals evaluated with."""
    values = {}
    fallbacks = {"batch_size": 32, "eval_iters": 50, "seed": 0, "dtype": "float32"}
    for key, fallback in fallbacks.items():
        given = getattr(cfg, key)
        values[key] = given if given is not None else run_config.get(key, fallback)
    if cfg.tasks is None and cfg.lm_eval:
        values["tasks"] = []  # the harness's tasks alone
    elif cfg.tasks is None:
        values["tasks"] = run_config.get("final_evals") or ["induction", "position"]
    return dataclasses.replace(cfg, **values)


def check_read(given: EvalConfig, tasks: list[str]) -> None:
    """A UserError for a key the command gives (given: its config before the run's values fill it)
    that none of tasks reads (TASK_KEYS; the harness's lines task: LINES_KEYS)."""
    defaults = EvalConfig()
    read = {key for task in tasks for key in TASK_KEYS[task]}
    if any(task in choice_task.TASKS for task in given.lm_eval):
        read |= set(LINES_KEYS)
    for key in dict.fromkeys(k for keys in TASK_KEYS.values() for k in keys):
        value = getattr(given, key)
        if key in read or value == getattr(defaults, key):
            continue
        readers = [task for task, keys in TASK_KEYS.items() if key in keys]
        raise UserError(
            f"{key}={value!r} is read by {' and '.join(readers)}, and tasks={tasks} has none of "
            f"them: leave {key} out, or add a task that reads it"
        )


def check_tokens(run: Run, source: Source, meta: dict, dataset: str, name: str) -> None:
    """The dataset must be in the model's own tokens, as train.py checks where it resumes or
    fine-tunes: another tokenizer's ids are other tokens to the model, or lie past its embedding."""
    own = run.config.get("dataset")
    hint = f", e.g. its own {own} (leave --dataset out)" if own else ""
    advice = f"evaluate {name} on a dataset made with its tokenizer{hint}"
    checkpoint.check_pretrained_tokenizer(source, meta, dataset, advice)
    checkpoint.check_vocabulary(run.model.config.vocab_size, meta, run.meta, dataset, advice)


def main(cfg: EvalConfig) -> None:
    source = parse_source(cfg.init_from)
    if source.kind not in ("resume", "gpt2", "hf"):
        raise UserError(
            f"init_from={cfg.init_from!r}: eval.py reads a run (resume) or pretrained "
            f"weights (gpt2*, hf:<folder>)"
        )
    run = load_run(source, cfg.out_dir, "cpu")
    given = cfg
    cfg = with_run_defaults(cfg, run.config)
    check_read(given, cfg.tasks)  # the tasks as the run's final_evals may have named them
    if cfg.lm_eval and source.kind == "resume":
        # before any work: the run's log takes the scores (log_scores), not after all are scored
        runlog.check_appendable(Path(cfg.out_dir), "eval.py --lm_eval")
    model = run.model
    zero_out_mixers(model, cfg.zero_mixers)
    block_size = model.config.block_size
    data, meta, split = task_data(cfg, run, source)

    with contextlib.ExitStack() as stack:
        folder = None
        if cfg.lm_eval:  # before any work: lm-eval there, its tasks known, their data at hand
            tasks = harness_tasks(cfg, run, data, meta, stack)
            # the model as a transformers folder, in a temporary folder (or the one it came from)
            where = source.where if source.kind == "hf" else None
            folder = stack.enter_context(harness.model_folder(model, run.meta, where))
        place = runtime.place(cfg.device, cfg.dtype, model.config.n_embd, training=False)
        model = model.to(place.device)
        batches = None
        if any(task in DATA_TASKS for task in cfg.tasks):
            seed = run.config.get("seed", 1337)  # the run's: its evaluation batches
            batches = Batches(data, block_size, cfg.batch_size, seed, place.device)
        # GPT-2's embedding rows past its 50257 tokens are padding
        vocab = min(run.tokenizer.n_vocab, model.config.vocab_size)
        results = run_tasks(cfg, model, batches, vocab, place.autocast(), split)
        for row in measures(results):
            # a measure of the model with mixers zeroed says so: it is not the run's
            print(json.dumps(row | ({"zero_mixers": cfg.zero_mixers} if cfg.zero_mixers else {})))
        if folder is not None:
            scores = harness_scores(cfg, run, model, place, tasks, folder)
            for task, values in scores.items():
                print(json.dumps({"task": "lm_eval", "name": task, **values}))
            if source.kind == "resume":
                log_scores(cfg, run, scores)


def task_data(cfg: EvalConfig, run: Run, source: Source) -> tuple[Path | None, dict | None, str]:
    """The dataset folder that cfg's tasks read (position, mqar and the project's own harness tasks;
    None where none does), its meta and the split they read, checked before any work: the model's
    own tokens, and a dataset the tasks fit."""
    reads_data = [t for t in cfg.tasks if t in DATA_TASKS]
    reads_data += [task for task in cfg.lm_eval if task in choice_task.TASKS]
    dataset = cfg.dataset or run.config.get("dataset", "")
    if reads_data and not dataset:
        raise UserError(
            f"tasks {', '.join(reads_data)} read a dataset's {cfg.split} split and "
            f"{cfg.init_from} names none: give --dataset=..."
        )
    if not reads_data:
        return None, None, cfg.split
    data = data_dir(dataset)
    meta = load_meta(data)
    name = f"the run in {cfg.out_dir}" if source.kind == "resume" else str(source)
    check_tokens(run, source, meta, dataset, name)
    recall.check_dataset(reads_data, meta, run.model.config.block_size, str(data))
    return data, meta, split_of(cfg.split, meta, data)


def zero_out_mixers(model: torch.nn.Module, layers: list[int]) -> None:
    """The token mixer (attention, or a recurrent layer) of each of these layers outputs zeros
    from now on, by a forward hook: the block adds nothing to the residual there, its MLP still
    runs. A UserError for a layer the model does not have."""
    blocks = model.transformer.h
    if missing := [i for i in layers if i >= len(blocks)]:
        raise UserError(
            f"zero_mixers={layers}: the model has {len(blocks)} layers (0 to {len(blocks) - 1}), "
            f"no layer {missing[0]}"
        )
    for i in layers:
        blocks[i].attn.register_forward_hook(lambda module, args, out: torch.zeros_like(out))


def split_of(split: str, meta: dict, data: Path) -> str:
    """The split that position and mqar read: split, held_out being the dataset's test split where
    it has one (else val); a UserError for a test split the dataset lacks."""
    split = splits_of(meta)[-1] if split == "held_out" else split
    if split not in splits_of(meta):
        raise UserError(
            f"split=test: {data} has no test split (prepared before there were test splits): "
            "prepare it again, or use --split=val"
        )
    return split


def harness_tasks(
    cfg: EvalConfig, run: Run, data: Path | None, meta: dict | None, stack: contextlib.ExitStack
) -> harness.Tasks:
    """cfg.lm_eval checked, before any work: lm-eval installed, each task known, its data on this
    machine or reachable; the project's own tasks' items (lines, next_line) written as the
    harness's tasks in a temporary folder."""
    harness.check_installed()
    include = None
    own = [task for task in cfg.lm_eval if task in choice_task.TASKS]
    if own:
        include = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="smallgpt-lines-")))
    for task in own:
        block_size = run.model.config.block_size
        items = choice_task.items_from_dataset(
            data, meta, run.tokenizer, cfg.examples, cfg.seed, block_size, task
        )
        choice_task.write_task(include, items, task)
    tasks = harness.resolve(cfg.lm_eval, include)
    harness.check_reachable(tasks)
    return tasks


def harness_scores(
    cfg: EvalConfig,
    run: Run,
    model: torch.nn.Module,
    place: runtime.Placement,
    tasks: harness.Tasks,
    folder: Path,
) -> dict[str, dict]:
    """{task: its metrics} from the harness on the transformers folder of the model, each
    log-likelihood task's with check_*: the harness's scores held against this project's scorer
    on the model itself (harness.check_scores), with lm_eval_check."""
    prefix = choice_task.prefix_token(run.tokenizer)
    dtype = str(place.dtype).removeprefix("torch.")
    block_size = model.config.block_size
    limit = cfg.lm_eval_limit
    results = harness.evaluate(
        folder, tasks, place.device, dtype, cfg.batch_size, limit, block_size, prefix, cfg.progress
    )
    scores = harness.measures(results, tasks)
    if cfg.lm_eval_check:
        encode = functools.partial(encode_prompt, run.tokenizer)
        amp = place.autocast()
        checks = harness.check_scores(results, tasks, model, encode, cfg.batch_size, prefix, amp)
        for task, check in checks.items():
            scores[task] |= {f"check_{key}": value for key, value in check.items()}
    return scores


def log_scores(cfg: EvalConfig, run: Run, scores: dict[str, dict]) -> None:
    """The harness's scores of a run into its log.jsonl (a benchmarks record at its checkpoint's
    iteration, each task's with the limit it was scored at, which compare.py reads) and, where the
    run logged to wandb, its summary."""
    settings = {"examples": cfg.examples, "seed": cfg.seed, "dtype": cfg.dtype}
    logged = {task: values | {"limit": cfg.lm_eval_limit} for task, values in scores.items()}
    iter_num = run.ckpt.get("iter_num", 0)
    out_dir = Path(cfg.out_dir)
    runlog.append_record(
        out_dir, event="benchmarks", iter=iter_num, lm_eval=logged, settings=settings
    )
    summary = {
        f"{task}_{metric}": value
        for task, values in scores.items()
        for metric, value in values.items()
        if not metric.startswith("check_")
    }
    runlog.summarize_logged_run(out_dir, run.config, summary)


def run_tasks(
    cfg: EvalConfig,
    model: torch.nn.Module,
    batches: Batches | None,
    vocab: int,
    amp: AbstractContextManager,
    split: str,
) -> dict:
    """recall.run_tasks with cfg's settings (an empty list: the task's default)."""
    return recall.run_tasks(
        cfg.tasks,
        model,
        batches,
        cfg.eval_iters,
        vocab,
        cfg.distances or None,
        cfg.induction_length,
        cfg.examples,
        cfg.batch_size,
        cfg.seed,
        amp,
        cfg.progress,
        split,
        cfg.lengths or None,
        cfg.depths or None,
        cfg.needle_tokens,
    )


def measures(results: dict) -> list[dict]:
    """recall.run_tasks's results as one flat record per measure."""
    rows = [{"task": "induction", **r} for r in results.get("induction", [])]
    if "position" in results:
        rows.append({"task": "position", "loss": results["position"]})
    if "mqar" in results:
        rows.append({"task": "mqar", **results["mqar"]})
    for task in recall.LONG_TASKS:
        rows += [{"task": task, **r} for r in results.get(task, [])]
    return rows


if __name__ == "__main__":
    run_cli(main, EvalConfig)
