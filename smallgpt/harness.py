"""Standard benchmarks through lm-evaluation-harness (`lm-eval`, an optional dependency): a model
this project loads, written as a transformers folder (hf.save, the export's classes), scored by the
harness's `hf` model on its tasks (HellaSwag, ARC, LAMBADA, PIQA, ...) or on the project's own
(lines, next_line: smallgpt/choice_task.py), and checked: the harness's log-likelihood of every
choice held against this project's scorer on the model itself. eval.py --lm_eval and
compare.py --lm_eval are the commands.
"""

import contextlib
import difflib
import functools
import logging
import os
import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from model import GPT
from smallgpt import choice_task, hf
from smallgpt.errors import UserError, first_line
from smallgpt.runlog import unreachable

INSTALL = "pip install 'lm-eval>=0.4.9' accelerate (or pip install -e '.[eval]')"
# the datasets builders that read local files: a task of one of them with local data_files needs no
# network
LOCAL_BUILDERS = ("json", "csv", "text", "parquet", "arrow")
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def check_installed() -> None:
    """A UserError naming the install command unless lm-eval and accelerate import."""
    for module in ("lm_eval", "accelerate"):
        try:
            __import__(module)
        except ImportError as e:
            raise UserError(
                f"--lm_eval scores with lm-evaluation-harness, an optional dependency ({module} "
                f"does not import: {first_line(e)}): {INSTALL}"
            ) from e


@dataclass(slots=True)
class Tasks:
    """The harness tasks of a command: the names as given, each as the harness knows it (the
    project's own: choice_task.HARNESS_NAMES), the folder of the project's task files (None without
    them), and the hub datasets that the others read, {task: (dataset_path, dataset_name)}."""

    names: list[str]
    harness_names: list[str]
    include: Path | None
    hub: dict[str, tuple[str, str | None]]


def task_manager(include: Path | None, names: list[str]) -> Any:
    """The harness's TaskManager over its own tasks where names has one, and the project's task
    files in include."""
    only_local = all(name in choice_task.TASKS for name in names)
    return indexed_tasks(str(include) if include else None, not only_local)


@functools.lru_cache(maxsize=4)
def indexed_tasks(include: str | None, defaults: bool) -> Any:
    """A TaskManager, made once per process for each folder (its scan of the harness's own ~15,000
    task files takes ~5 s)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include, include_defaults=defaults)


def resolve(names: list[str], include: Path | None) -> Tasks:
    """names (the harness's task, group or tag names, or the project's: choice_task.TASKS) as Tasks,
    checked: an unknown name is a UserError with the close matches."""
    harness_names = [choice_task.HARNESS_NAMES.get(n, n) for n in names]
    manager = task_manager(include, names)
    index = manager.task_index
    hub = {}
    for name, harness_name in zip(names, harness_names, strict=True):
        if harness_name not in index:
            close = difflib.get_close_matches(name, manager.all_tasks, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise UserError(
                f"lm_eval: {name!r} is not a task, group or tag of lm-evaluation-harness{hint}; "
                f"`lm-eval ls tasks` lists them, and {' and '.join(choice_task.TASKS)} are the "
                "project's own"
            )
        for leaf, cfg in leaf_configs(index, harness_name):
            path = cfg.get("dataset_path")
            if path and not reads_local_files(cfg):
                hub[leaf] = (path, cfg.get("dataset_name"))
    return Tasks(names, harness_names, include, hub)


def leaf_configs(index: dict, name: str, seen: set | None = None) -> Iterator[tuple[str, dict]]:
    """The (task, YAML config) of each task under name in the harness's index: itself, a group's
    tasks or a tag's, as far down as they go."""
    from lm_eval.tasks._index import Kind

    seen = set() if seen is None else seen
    if name in seen or name not in index:
        return
    seen.add(name)
    entry = index[name]
    if entry.kind == Kind.TAG:
        for task in sorted(entry.tags):
            yield from leaf_configs(index, task, seen)
    elif entry.kind == Kind.GROUP:
        for task in (entry.cfg or {}).get("task", []):
            if isinstance(task, str):
                yield from leaf_configs(index, task, seen)
            elif isinstance(task, dict):  # a task written inside the group's YAML
                yield task.get("task", name), task
    else:
        yield name, entry.cfg or {}


def reads_local_files(cfg: dict) -> bool:
    """Whether a task's data is on this machine: a local builder with files that are there, or a
    folder path."""
    path = cfg.get("dataset_path", "")
    if path in LOCAL_BUILDERS:
        files = (cfg.get("dataset_kwargs") or {}).get("data_files") or {}
        listed = files.values() if isinstance(files, dict) else [files]
        flat = [f for f in listed for f in ([f] if isinstance(f, str) else f)]
        return all(Path(f).exists() for f in flat)
    return Path(path).is_dir()


def check_reachable(tasks: Tasks) -> None:
    """A UserError, before any work, where a task's data cannot be had: offline mode
    (HF_DATASETS_OFFLINE or HF_HUB_OFFLINE) without it in the datasets cache, or online with the
    hub out of reach."""
    if not tasks.hub:
        return
    import datasets
    import huggingface_hub.constants

    listed = ", ".join(f"{task} ({path})" for task, (path, _) in tasks.hub.items())
    offline = datasets.config.HF_DATASETS_OFFLINE or huggingface_hub.constants.HF_HUB_OFFLINE
    if offline:
        for task, (path, name) in tasks.hub.items():
            try:
                with quiet():
                    datasets.load_dataset_builder(path, name)
            except Exception as e:  # datasets raises its own errors for a missing cache
                raise UserError(
                    f"lm_eval: {task} reads {path} from the Hugging Face hub, and offline "
                    f"(HF_DATASETS_OFFLINE or HF_HUB_OFFLINE) it is not in the datasets cache "
                    f"({first_line(e)}): run once with the network to cache it"
                ) from e
        return
    if any(os.environ.get(v) for v in PROXY_VARIABLES):
        return  # the hub may be reachable only through the proxy: the harness will say
    endpoint = huggingface_hub.constants.ENDPOINT
    if why := unreachable(endpoint):
        raise UserError(
            f"lm_eval: {listed} read their data from the Hugging Face hub, and {endpoint} cannot "
            f"be reached ({why}): run where the network is, or with the data cached and "
            f"HF_DATASETS_OFFLINE=1; the project's own tasks ({', '.join(choice_task.TASKS)}) "
            "need no network"
        )


@contextlib.contextmanager
def quiet(progress: bool = True) -> Iterator[None]:
    """The harness's and datasets' log lines at errors only while inside (its info, and its
    truncation warning a line per long item, would bury the results); progress=False: no progress
    bars of datasets' either (the harness's own always show)."""
    import datasets

    loggers = [logging.getLogger(name) for name in ("lm_eval", "lm-eval", "datasets")]
    levels = [logger.level for logger in loggers]
    bars_were_off = datasets.are_progress_bars_disabled()
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    if not progress:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
        if not bars_were_off:
            datasets.enable_progress_bars()


@contextlib.contextmanager
def model_folder(model: GPT, meta: dict | None, folder: str | None) -> Iterator[Path]:
    """A transformers folder of the model: folder itself where the model was read from one, else
    model and its dataset's tokenizer (meta; None: GPT-2's) written to a temporary folder outside
    any run's, removed on the way out."""
    if folder is not None:
        yield Path(folder)
        return
    hf_model = hf.to_hf(model)  # a model no stock class holds: one line, before the folder
    with tempfile.TemporaryDirectory(prefix="smallgpt-lm-eval-") as tmp:
        written = Path(tmp) / "model"
        hf.save(hf_model, hf.tokenizer(meta or {"tokenizer": "gpt2"}), written)
        yield written


def evaluate(
    folder: Path,
    tasks: Tasks,
    device: str,
    dtype: str,
    batch_size: int,
    limit: int | None,
    max_length: int,
    prefix: int,
    progress: bool = True,
) -> dict:
    """The harness's results for tasks on the transformers folder (its simple_evaluate: results,
    and each item's requests and log-likelihoods under 'samples'), scored with the model's own
    context (max_length) and prefix token (choice_task.prefix_token); progress: its bars."""
    from lm_eval import simple_evaluate

    model_args = {
        "pretrained": str(folder),
        "dtype": dtype,
        "max_length": max_length,
        "prefix_token_id": prefix,
    }
    with quiet(progress):
        manager = task_manager(tasks.include, tasks.names)
        return simple_evaluate(
            model="hf",
            model_args=model_args,
            tasks=tasks.harness_names,
            device=device,
            batch_size=batch_size,
            limit=limit,
            log_samples=True,
            task_manager=manager,
            bootstrap_iters=1000,
        )


def measures(results: dict, tasks: Tasks) -> dict[str, dict]:
    """{task: {metric: value, ..., 'n': items}} from the harness's results, each task under the
    name it was given (lines, not its harness name); groups and a tag's tasks under their own."""
    given = dict(zip(tasks.harness_names, tasks.names, strict=True))
    out = {}
    for name, row in results["results"].items():
        values = {}
        for key, value in row.items():
            metric, _, _filter = key.partition(",")
            if isinstance(value, int | float) and key != "sample_len" and _filter:
                values[metric] = float(value)
        counts = results.get("n-samples", {}).get(name)
        if counts:
            values["n"] = counts["effective"]
        out[given.get(name, name)] = values
    return out


def check_scores(
    results: dict,
    tasks: Tasks,
    model: GPT,
    encode: Any,
    batch_size: int,
    prefix: int,
    amp: AbstractContextManager | None = None,
) -> dict[str, dict]:
    """Each log-likelihood task's requests scored again by this project's scorer on the model
    itself (choice_task.loglikelihoods): {task: {'requests', 'max_abs_diff', 'same_choice',
    'items'}}: the largest difference of a request's log-likelihood, and the items whose chosen
    (highest-scored) choice is the same."""
    given = dict(zip(tasks.harness_names, tasks.names, strict=True))
    out = {}
    for task, samples in results.get("samples", {}).items():
        scored = [s for s in samples if is_loglikelihood(s)]
        if not scored:
            continue
        requests = [tuple(args) for s in scored for args in s["arguments"]]
        ours = choice_task.loglikelihoods(model, encode, requests, batch_size, prefix, amp)
        theirs = [float(r[0]) for s in scored for r in s["filtered_resps"]]
        diff = max(abs(a - b) for a, b in zip(ours, theirs, strict=True))
        same = 0
        start = 0
        for s in scored:
            end = start + len(s["arguments"])
            same += int(np.argmax(ours[start:end]) == np.argmax(theirs[start:end]))
            start = end
        out[given.get(task, task)] = {
            "requests": len(requests),
            "max_abs_diff": diff,
            "same_choice": same,
            "items": len(scored),
        }
    return out


def is_loglikelihood(sample: dict) -> bool:
    """Whether a sample's requests are (context, continuation) pairs scored by log-likelihood (not
    generation's (context, settings), nor a rolling log-likelihood's text alone)."""
    args = sample.get("arguments") or []
    resps = sample.get("filtered_resps") or []
    pairs = all(len(a) == 2 and all(isinstance(x, str) for x in a) for a in args)
    scores = all(isinstance(r, list | tuple) and isinstance(r[0], float) for r in resps)
    return bool(args) and len(args) == len(resps) and pairs and scores
