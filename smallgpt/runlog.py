"""A run's record: out_dir/log.jsonl (one JSON object per line: the config, then train and eval
records), always written, and wandb when asked for; and read_run, which reads a log.jsonl back for
reports and benchmarks.
"""

import contextlib
import json
import math
import os
import platform
import socket
import subprocess
import tempfile
import time
import urllib.parse
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model import GPTConfig
from smallgpt.atomic import atomic_open
from smallgpt.configs import TrainConfig
from smallgpt.errors import UserError, first_line


class RunLog:
    """Metrics to out_dir/log.jsonl (appended) and, if cfg.wandb_log, to wandb; the config also to
    config.json."""

    def __init__(self, cfg: TrainConfig, model_config: GPTConfig, start_iter: int) -> None:
        out = Path(cfg.out_dir)
        self.path = out / "log.jsonl"
        self.wandb = None
        end_line(self.path)
        with atomic_open(out / "config.json", "w") as f:
            json.dump(asdict(cfg), f, indent=1)
        if cfg.wandb_log:  # a resumed run goes on in the wandb run it started
            self.wandb = start_wandb(
                cfg,
                f"{Path(cfg.dataset).name}-{model_config.attention_label}",
                self.wandb_id() if start_iter else None,
            )
        self.write(
            event="config",
            config=asdict(cfg),
            model_config=asdict(model_config),
            start_iter=start_iter,
            versions=versions(),
            wandb_id=self.wandb and self.wandb.id,
        )

    def wandb_id(self) -> str | None:
        """The wandb run id of the latest config record that has one in this log."""
        return logged_wandb_id(self.path)

    def write(self, **record: Any) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record | {"time": time.time()}) + "\n")
        if self.wandb is not None and "iter" in record:
            self.wandb.log(
                {k: v for k, v in record.items() if isinstance(v, int | float)}, step=record["iter"]
            )

    def summarize(self, values: dict[str, float]) -> None:
        """values into the wandb run's summary (the run table's columns), if wandb logs this run."""
        if self.wandb is not None:
            self.wandb.summary.update(values)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


def end_line(path: Path) -> None:
    """Where the log at path ends in a line cut short by a kill, end that line, so it stays a line
    of its own."""
    if path.is_file() and path.stat().st_size:
        with open(path, "rb+") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")


def logged_wandb_id(path: Path) -> str | None:
    """The wandb run id of the latest config record that has one in the log at path."""
    ids = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        with contextlib.suppress(json.JSONDecodeError):  # a line cut short by a kill
            ids.append(json.loads(line).get("wandb_id"))
    return next((i for i in reversed(ids) if i), None)


def append_record(run_dir: Path, **record: Any) -> None:
    """record (with its time) as a line of the log.jsonl of the finished run in run_dir, for a
    measure taken after its training (eval.py's benchmarks)."""
    path = run_dir / "log.jsonl"
    end_line(path)
    with open(path, "a") as f:
        f.write(json.dumps(record | {"time": time.time()}) + "\n")


def check_appendable(run_dir: Path, what: str) -> None:
    """A UserError, before any work, where append_record could not add a record to the log of the
    run in run_dir: the log opened to read and write, as append_record opens it (nothing written),
    or a file made and removed in the folder where there is no log yet. What the system says, not
    the mode bits, since root writes whatever they say; what: the command, for the message."""
    path = run_dir / "log.jsonl"
    try:
        if path.exists():
            with open(path, "rb+"):
                pass
        else:
            with tempfile.TemporaryFile(dir=run_dir):
                pass
    except OSError as e:
        raise UserError(
            f"{what} appends its scores to {path}, which cannot be written ({e.strerror or e}): "
            f"make {run_dir} writable, or evaluate a copy of the run (nothing was scored)"
        ) from e


def summarize_logged_run(run_dir: Path, config: dict, values: dict[str, float]) -> None:
    """values into the summary of the wandb run that the run in run_dir (its config) logged to,
    resumed for it under its id; nothing where the run did not log to wandb."""
    run_id = logged_wandb_id(run_dir / "log.jsonl")
    if not config.get("wandb_log") or run_id is None:
        return
    known = {f.name for f in fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in config.items() if k in known})
    # the run's folder where it is now, wherever it was trained
    cfg = replace(cfg, out_dir=str(run_dir))
    run = start_wandb(cfg, run_dir.name, run_id)
    run.summary.update(values)
    run.finish()


def start_wandb(cfg: TrainConfig, default_name: str, run_id: str | None = None) -> Any:
    """A wandb run (the run run_id again, if given), honouring WANDB_MODE; online without a
    reachable server it logs offline instead of waiting."""
    if os.environ.get("WANDB_MODE") == "":  # an empty WANDB_MODE crashes wandb.init
        del os.environ["WANDB_MODE"]
    import wandb

    mode = None  # WANDB_MODE's, else online
    url = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    if os.environ.get("WANDB_MODE", "online") == "online" and (why := unreachable(url)):
        mode = "offline"  # online wandb would wait out its timeout for a network that is not there
        print(
            f"wandb: cannot reach {url} ({why}): logging offline to {cfg.out_dir}/wandb instead; "
            f"upload it later with `wandb sync`, or set WANDB_MODE=offline to skip this check"
        )

    try:
        return wandb.init(
            project=cfg.wandb_project,
            name=cfg.wandb_run_name or default_name,
            group=cfg.wandb_group,
            mode=mode,
            tags=cfg.wandb_tags,
            config=asdict(cfg),
            dir=cfg.out_dir,
            id=run_id,
            resume="allow" if run_id else None,
        )
    except Exception as e:  # wandb raises its own errors (no API key, no network)
        raise UserError(
            f"wandb could not start ({type(e).__name__}: {first_line(e)}); "
            f"set WANDB_MODE=offline to log locally, or --wandb_log=False"
        ) from e


def unreachable(url: str, timeout: float = 3.0) -> str | None:
    """Why no TCP connection to url's host opens within timeout, or None if one does."""
    u = urllib.parse.urlparse(url)
    try:
        socket.create_connection(
            (u.hostname, u.port or (443 if u.scheme == "https" else 80)), timeout=timeout
        ).close()
    except OSError as e:
        return str(e) or type(e).__name__
    return None


def versions() -> dict[str, str | None]:
    try:
        sha = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
                timeout=5,
                cwd=Path(__file__).resolve().parent.parent,
            ).stdout.strip()
            or None
        )
    except OSError:
        sha = None
    return {
        "git_sha": sha,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
    }


def read_run(run_dir: Path) -> dict:
    """The latest run in run_dir/log.jsonl: its config and eval/train records, one per iteration (a
    resume's records replace those a killed process logged after the checkpoint it resumed),
    wall-clock continued across resumes (a record's wall_s: the time lost to a kill included); torn:
    whether the log ends in a line cut short (a process killed while writing it, whatever it held);
    final_iter: the iteration of the run's final evaluation (the latest attempt's max_iters, or
    where an eval_only attempt started); recall: the recall record logged at final_iter, or None;
    benchmarks: {task: {limit: its metrics}} of the harness's tasks that eval.py --lm_eval logged
    for the checkpoint of final_iter, by the items it was limited to (None: all; a later record's
    over an earlier's);
    diverged: the record of a training that stopped non-finite, where the log ends with one (None
    otherwise); stopped: the record of an early stop (train.py --stop_at_accuracy), whose
    iteration is then final_iter (None otherwise)."""
    path = run_dir / "log.jsonl"
    records, torn = log_records(path)
    records = records[latest_start(records, path) :]
    run = by_iteration(records)
    return {
        "name": run_dir.name,
        "config": records[0]["config"],
        "model_config": records[0]["model_config"],
        "evals": sorted(run["evals"].values(), key=lambda r: r["iter"]),
        "trains": sorted(run["trains"].values(), key=lambda r: r["iter"]),
        "torn": torn,
        "final_iter": run["final_iter"],
        "recall": run["recalls"].get(run["final_iter"]),
        "benchmarks": run["benchmarks"].get(run["final_iter"], {}),
        "diverged": records[-1] if records[-1]["event"] == "diverged" else None,
        "stopped": run["stopped"],
    }


def log_records(path: Path) -> tuple[list[dict], bool]:
    """The records of a log.jsonl, and whether it ends in a line cut short (torn). A line cut short
    is left out where it is the last or a config record follows it (a resume); any other line that
    is not JSON is a UserError."""
    records = []
    torn = False
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for i, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            # a process killed mid-write leaves its last line cut short (then a resume may follow)
            if i == len(lines) or '"event": "config"' in lines[i]:
                torn = i == len(lines)
                continue
            raise UserError(
                f"{path} line {i} is not a JSON record ({e.msg}): not a log written by train.py"
            ) from e
    return records, torn


def latest_start(records: list[dict], path: Path) -> int:
    """The index of the latest fresh start's config record in records (a resume's is not one)."""
    starts = [
        i
        for i, r in enumerate(records)
        if r.get("event") == "config"
        and r.get("start_iter", int(r["config"]["init_from"] == "resume")) == 0
    ]
    if not starts:
        raise UserError(f"{path} holds no run's config record: not a log written by train.py")
    return starts[-1]


def by_iteration(records: list[dict]) -> dict:
    """One run's records, its fresh start's config first, by iteration: {'evals', 'trains',
    'recalls'}, each {iter: record} (a resume's records replace those logged after its checkpoint;
    evals and trains get wall_s, the wall-clock continued across resumes), 'benchmarks' ({iter:
    {task: {limit: metrics}}}), 'final_iter' and 'stopped' (the latest attempt's early stop, whose
    iteration is then final_iter, or None)."""
    evals = {}
    trains = {}
    recalls = {}
    benchmarks = {}
    stopped = None
    offset = 0.0  # the wall-clock seconds of the attempts before this one
    last = 0.0  # ... and of this one, so far
    for r in records:
        if r["event"] == "config":
            # an attempt: its own clock and final evaluation; it replaces what came after its start
            offset += last
            last = 0.0
            config = r["config"]
            final_iter = r.get("start_iter", 0) if config.get("eval_only") else config["max_iters"]
            stopped = None
            for kept in (evals, trains):
                for it in [it for it in kept if it > r.get("start_iter", math.inf)]:
                    del kept[it]
        elif r["event"] == "stop":
            # the evaluation that reached stop_at_accuracy: the attempt's final one
            stopped = r
            final_iter = r["iter"]
        elif r["event"] == "recall":
            # smallgpt/recall.py's tasks at the final evaluation (train.py --final_evals)
            recalls[r["iter"]] = r
        elif r["event"] == "benchmarks":
            # lm-evaluation-harness's tasks on the checkpoint of that iteration (eval.py --lm_eval)
            at = benchmarks.setdefault(r["iter"], {})
            for task, values in r["lm_eval"].items():
                at.setdefault(task, {})[values.get("limit")] = values
        elif r["event"] in ("eval", "train"):
            last = r["elapsed_s"]
            kept = evals if r["event"] == "eval" else trains
            kept[r["iter"]] = r | {"wall_s": offset + r["elapsed_s"]}
    return {
        "evals": evals,
        "trains": trains,
        "recalls": recalls,
        "benchmarks": benchmarks,
        "final_iter": final_iter,
        "stopped": stopped,
    }


def unfinished(run: dict, final_iter: int | None = None) -> str | None:
    """Why a run read_run returned is not finished, or None when it is: finished means its final
    evaluation (at final_iter; default, the run's own) is logged, and whole: the log does not end in
    a line cut short. A run that diverged (non-finite) is finished too: resumed, it would again;
    one that stopped early (stop_at_accuracy) is finished at the evaluation it stopped at."""
    final_iter = run["final_iter"] if final_iter is None or run.get("stopped") else final_iter
    if run.get("diverged") and not run["torn"]:
        return None
    if run["torn"]:
        return "its log's last line is cut short (killed while writing it)"
    if not run["evals"]:
        return "no evaluation logged yet"
    if not any(e["iter"] == final_iter for e in run["evals"]):
        last = run["evals"][-1]["iter"]
        return f"its last evaluation is at iteration {last}, its final one at {final_iter}"
    if run["config"].get("final_evals") and run["recall"] is None:
        return "its final_evals are not logged yet (killed while they ran)"
    return None
