"""A run's record: out_dir/log.jsonl (one JSON object per line: the config, then train and eval records), always
written, and wandb when asked for; and read_run, which reads a log.jsonl back for reports and benchmarks.
"""

import contextlib
import json
import math
import os
import platform
import socket
import subprocess
import time
import urllib.parse
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model import GPTConfig
from smallgpt.atomic import atomic_open
from smallgpt.configs import TrainConfig
from smallgpt.errors import UserError, first_line


class RunLog:
    """Metrics to out_dir/log.jsonl (appended) and, if cfg.wandb_log, to wandb; the config also to config.json."""

    def __init__(self, cfg: TrainConfig, model_config: GPTConfig, start_iter: int) -> None:
        out = Path(cfg.out_dir)
        self.path, self.wandb = out / "log.jsonl", None
        if (
            self.path.is_file() and self.path.stat().st_size
        ):  # a line cut short by a kill stays a line of its own
            with open(self.path, "rb+") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")
        with atomic_open(out / "config.json", "w") as f:
            json.dump(asdict(cfg), f, indent=1)
        if cfg.wandb_log:  # a resumed run goes on in the wandb run it started
            self.wandb = start_wandb(
                cfg,
                f"{Path(cfg.dataset).name}-{model_config.attention_kind}",
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
        ids = []
        for line in self.path.read_text().splitlines() if self.path.is_file() else []:
            with contextlib.suppress(json.JSONDecodeError):  # a line cut short by a kill
                ids.append(json.loads(line).get("wandb_id"))
        return next((i for i in reversed(ids) if i), None)

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


def start_wandb(cfg: TrainConfig, default_name: str, run_id: str | None = None) -> Any:
    """A wandb run (the run run_id again, if given), honouring WANDB_MODE; online without a reachable server it logs
    offline instead of waiting."""
    if os.environ.get("WANDB_MODE") == "":  # an empty WANDB_MODE crashes wandb.init
        del os.environ["WANDB_MODE"]
    import wandb

    mode = None  # WANDB_MODE's, else online
    url = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    if os.environ.get("WANDB_MODE", "online") == "online" and (why := unreachable(url)):
        mode = "offline"  # online wandb would wait ~100 s for a network that is not there
        print(
            f"wandb: cannot reach {url} ({why}): logging offline to {cfg.out_dir}/wandb instead; upload it "
            f"later with `wandb sync`, or set WANDB_MODE=offline to skip this check"
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
    """The latest run in run_dir/log.jsonl: its config and eval/train records, one per iteration (a resume's records
    replace those a killed process logged after the checkpoint it resumed), wall-clock continued across resumes (a
    record's wall_s: the time lost to a kill included); torn: whether the log ends in a line cut short (a process
    killed while writing it, whatever it held); final_iter: the iteration of the run's final evaluation (the latest
    attempt's max_iters, or where an eval_only attempt started); recall: the recall record logged at final_iter, or
    None."""
    path, records, torn = run_dir / "log.jsonl", [], False
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for i, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if (
                i == len(lines) or '"event": "config"' in lines[i]
            ):  # a process killed mid-write leaves its last
                torn = i == len(lines)  # line cut short (then a resume may follow)
                continue
            raise UserError(
                f"{path} line {i} is not a JSON record ({e.msg}): not a log written by train.py"
            ) from e
    starts = [
        i
        for i, r in enumerate(records)
        if r.get("event") == "config"  # a fresh start, not a resume
        and r.get("start_iter", int(r["config"]["init_from"] == "resume")) == 0
    ]
    if not starts:
        raise UserError(f"{path} holds no run's config record: not a log written by train.py")
    records = records[starts[-1] :]
    offset, last = 0.0, 0.0
    evals, trains, recalls = (
        {},
        {},
        {},
    )  # by iteration: a resume replaces what came after its checkpoint
    for r in records:
        if r["event"] == "config":
            offset, last = offset + last, 0.0
            final_iter = (
                r.get("start_iter", 0) if r["config"].get("eval_only") else r["config"]["max_iters"]
            )
            for kept in (evals, trains):
                for it in [it for it in kept if it > r.get("start_iter", math.inf)]:
                    del kept[it]
        elif (
            r["event"] == "recall"
        ):  # smallgpt/recall.py's tasks at the final evaluation (train.py --final_evals)
            recalls[r["iter"]] = r
        else:
            last = r["elapsed_s"]
            (evals if r["event"] == "eval" else trains)[r["iter"]] = r | {
                "wall_s": offset + r["elapsed_s"]
            }
    return {
        "name": run_dir.name,
        "config": records[0]["config"],
        "model_config": records[0]["model_config"],
        "evals": sorted(evals.values(), key=lambda r: r["iter"]),
        "trains": sorted(trains.values(), key=lambda r: r["iter"]),
        "torn": torn,
        "final_iter": final_iter,
        "recall": recalls.get(final_iter),
    }


def unfinished(run: dict, final_iter: int | None = None) -> str | None:
    """Why a run read_run returned is not finished, or None when it is: finished means its final evaluation (at
    final_iter; default, the run's own) is logged, and whole: the log does not end in a line cut short."""
    final_iter = run["final_iter"] if final_iter is None else final_iter
    if run["torn"]:
        return "its log's last line is cut short (killed while writing it)"
    if not run["evals"]:
        return "no evaluation logged yet"
    if not any(e["iter"] == final_iter for e in run["evals"]):
        return f"its last evaluation is at iteration {run['evals'][-1]['iter']}, its final one at {final_iter}"
    if run["config"].get("final_evals") and run["recall"] is None:
        return "its final_evals are not logged yet (killed while they ran)"
    return None
