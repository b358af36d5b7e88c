"""Compare attention variants: train MHA, GQA, MQA (and MLA) versions of one config over seeds (and sizes, and MHA ->
GQA/MQA/MLA conversions), then report what each costs and scores, with intervals that tell a difference from noise.

    python compare.py config/compare/cpu.py --seeds=3                 # sweep + report in the config's out_dir
    python compare.py config/compare/cpu.py --variants=[mha,gqa2,mqa,mla32] --match=params  # MLA beside them
    python compare.py config/compare/cpu.py --seeds=3 --mode=plan     # the runs and an estimated time, no training
    python compare.py config/compare/cpu.py --match=[width,params]    # also variants widened to MHA's parameters
    python compare.py config/compare/cpu.py --convert=True --convert_methods=[mean,first,random] \
        --uptrain_fractions=[0,0.05,0.1]                                # the GQA paper's conversion ablations
    python compare.py config/compare/cpu.py --mode=report             # the report alone, from the runs' logs
    python compare.py config/train_gpt2.py --mode=costs               # parameters and KV-cache bytes of every n_kv_head

Positional arguments and --key=value flags of train.py's TrainConfig describe the base run; the keys below steer
the comparison. Each run trains in <out_dir>/<variant>-s<seed> (sizes: <n_layer>x<n_embd>-<variant>-s<seed>) with
wandb group <out_dir name> and tags naming its variant, seed and size.
"""

# configurator first: a Ctrl-C while torch imports is then one line, not a traceback
from configurator import given_values, parse_config, run_cli, split_args
from errors import UserError

# isort: split
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

import report
import runtime
import sweep
from atomic import atomic_open, folder_lock, lock_holder
from configs import CompareConfig, TrainConfig, repeated
from convert import check_latent_target
from dataset import data_dir, load_meta, vocab_size_of
from measure import cached_step_throughput, default_kv_heads, table, training_seconds
from model import GPT, GPTConfig
from runtime import Placement


def variant(base: TrainConfig, name: str, vocab_size: int = 1) -> GPTConfig:
    """The base run's model as the variant name says (mha, gqa<n_kv_head>, mqa, mla<kv_lora_rank>; -sssl64...)."""
    return sweep.variant_config(dataclasses.replace(base.model_config(vocab_size), n_kv_head=base.n_head), name)


def timings(runs: list[sweep.Run], base: TrainConfig, place: Placement) -> dict[tuple, tuple[float, float]]:
    """Each shape's seconds per training step and per evaluation batch (measure.training_seconds: 5 timed steps)."""
    shapes = {r.shape: r.model for r in runs}
    return {k: training_seconds(m, base.batch_size, base.optimizer, place) for k, m in shapes.items()}


def show_plan(runs: list[sweep.Run], times: dict[tuple, tuple[float, float]], base: TrainConfig,
              device: str) -> str:
    """The runs a sweep makes, their tokens and estimated times, and the total."""
    waiting = [r for r in runs if not sweep.finished(r)]
    rows = [{"run": r.dir.name, "iters": r.iters, "tokens": r.iters * r.tokens_per_iter,
             "estimated s": round(sweep.estimated_seconds(r, times, base.eval_iters)),
             "state": "to run" if r in waiting else "finished"} for r in runs]
    todo = sum(sweep.estimated_seconds(r, times, base.eval_iters) for r in waiting)
    text = (f"{table(rows)}\n\n{len(runs)} runs, {len(waiting)} to run: about {sweep.clock(todo)} on "
            f"{device} (5 timed training steps and 3 evaluation batches per shape, plus "
            f"{sweep.STARTUP_S:.0f} s per run to start train.py), plus the decode-speed measurement")
    print(text)
    return text


def measure_speeds(cfg: CompareConfig, runs: list[sweep.Run], root: Path, device: str) -> None:
    """The cached-step decode speed on device of each shape not measured yet, speed_repeats times interleaved over
    the shapes (so drift on a shared machine spreads over all of them), into root/speed.json."""
    path = root / report.SPEED_FILE
    stored = json.loads(path.read_text()) if path.is_file() else {}
    shapes = {report.speed_key(r.model, cfg.decode_context, cfg.decode_batch): r.model for r in runs}
    todo = {k: m for k, m in shapes.items() if len(stored.get(k, [])) < cfg.speed_repeats}
    if not todo:
        return
    print(f"decode speed of {len(todo)} shapes, batch {cfg.decode_batch} at {cfg.decode_context} positions, "
          f"{cfg.speed_repeats} repeats ...", flush=True)
    t0, fresh = time.perf_counter(), {k: [] for k in todo}
    for _ in range(cfg.speed_repeats):
        for k, m in todo.items():
            fresh[k].append(cached_step_throughput(m, cfg.decode_batch, cfg.decode_context, cfg.decode_steps, device))
    with atomic_open(path, "w") as f:
        json.dump(stored | fresh, f, indent=1)
    print(f"measured in {time.perf_counter() - t0:.0f} s: {path}")


def costs(cfg: CompareConfig, base: TrainConfig) -> str:
    """Parameters and KV-cache bytes for every n_kv_head that divides n_head and each MLA or windowed variant of
    --variants (no training)."""
    vocab = vocab_size_of(base.dataset) or 50304  # GPT-2's, padded
    rows = []
    divisors = sorted({d for d in range(1, base.n_head + 1) if base.n_head % d == 0}, reverse=True)
    for name in [f"gqa{g}" for g in divisors] + [n for n in cfg.variants if n.startswith("mla") or "-" in n]:
        mcfg = variant(base, name, vocab)
        with torch.device("meta"):
            model = GPT(mcfg)
        kv = mcfg.kv_cache_bytes(1, mcfg.block_size, getattr(torch, cfg.kv_dtype))
        kind = f"MLA (kv_lora_rank={mcfg.kv_lora_rank})" if mcfg.kv_lora_rank else mcfg.attention_kind
        kind += f", window {mcfg.window} in {mcfg.window_pattern}" if mcfg.window else ""
        rows.append({"n_kv_head": mcfg.n_kv_head, "kind": kind, "params (M)": round(model.num_params() / 1e6, 2),
                     "attention params/layer": model.attention_params_per_layer(),
                     f"KV cache/sequence @ {mcfg.block_size} ({cfg.kv_dtype}, MiB)": round(kv / 2**20, 2)})
    text = table(rows)
    print(text)
    return text


def parse(argv: list[str]) -> tuple[CompareConfig, TrainConfig]:
    ours, train_args = split_args(argv, CompareConfig)
    cfg = dataclasses.replace(parse_config(CompareConfig, ours), train_args=train_args)
    base = parse_config(TrainConfig, train_args)
    if not cfg.variants:
        cfg.kv_heads = cfg.kv_heads or default_kv_heads(base.n_head)
    names, key = sweep.variant_names(cfg, base.n_head), "variants" if cfg.variants else "kv_heads"
    given = given_values(CompareConfig, ours)
    if base.window is not None:
        raise UserError(f"window={base.window} in the base run: compare.py gives each variant its local layers by "
                        f"name, e.g. --variants=[mha,mha{sweep.window_suffix(base)}]")
    if not cfg.convert and (steer := [k for k in ("convert_methods", "uptrain_fractions", "uptrain_lr_scale")
                                      if k in given]):
        raise UserError(f"{', '.join(steer)} given without --convert=True: add it to convert, or drop them")
    if cfg.convert and "mha" not in names:
        raise UserError(f"convert=True converts the MHA runs: {key}={getattr(cfg, key)} must hold "
                        + (f"n_head={base.n_head}" if key == "kv_heads" else "mha"))
    same = repeated([round(f * base.max_iters) for f in cfg.uptrain_fractions])
    if cfg.convert and same is not None:
        raise UserError(f"uptrain_fractions={cfg.uptrain_fractions} give {same} of max_iters={base.max_iters} "
                        f"iterations twice: the same uptraining twice; give fractions 1/{base.max_iters} apart or more")
    for _, sbase in sweep.sizes(cfg.sizes, base):
        for name in names:  # each variant must be a valid model at each size before anything trains
            try:
                model = variant(sbase, name)
            except ValueError as e:
                raise UserError(f"{key}={getattr(cfg, key)} at {sbase.n_layer}x{sbase.n_embd}: {e}") from e
            if cfg.convert and model.kv_lora_rank is not None:  # and each MLA conversion possible
                try:
                    check_latent_target(model)
                except UserError as e:
                    raise UserError(f"convert=True to {name} at {sbase.n_layer}x{sbase.n_embd}: {e}") from e
    return cfg, base


def train(cfg: CompareConfig, base: TrainConfig, root: Path) -> None:
    """The sweep (or, with mode 'plan', what it would run). SIGTERM or SIGINT stops it cleanly: its train.py saves
    and ends, one line says where the sweep stopped, and it exits 143 or 130; run the same command to resume."""
    vocab = vocab_size_of(base.dataset)
    if vocab is None and cfg.mode != "plan":
        load_meta(data_dir(base.dataset))  # a sweep stops here: the missing dataset's one-line error
    runs = sweep.plan(cfg, base, vocab or 50304, root)  # a plan needs no data: GPT-2's padded vocabulary stands in
    if "mha" not in sweep.variant_names(cfg, base.n_head):
        key, add = ("variants", "mha") if cfg.variants else ("kv_heads", base.n_head)
        print(f"no MHA in {key}={getattr(cfg, key)} (n_head={base.n_head}): the report compares these variants but "
              f"shows no difference to MHA; add {add} to {key} for that", flush=True)
    with sweep.Stop() as stop:
        try:
            place = runtime.place(base.device, base.dtype, base.n_embd)  # as each run's train.py decides
            timed = runs if cfg.mode == "plan" else [r for r in runs if not sweep.finished(r)]  # to estimate
            times = timings(timed, base, place)
            if cfg.mode == "plan":
                show_plan(runs, times, base, place.device)
                return
            with folder_lock(root, "compare.py"):  # one sweep in a folder at a time (each run locks its own too)
                sweep.launch_all(runs, times, base.eval_iters, stop)
                stop.where = "while measuring the decode speeds"
                measure_speeds(cfg, runs, root, place.device)
        except sweep.Stopped as e:
            print(f"{e}: {sum(map(sweep.finished, runs))} of {len(runs)} runs finished; run the same command again "
                  f"to resume (a run cut short goes on from its checkpoint)", file=sys.stderr, flush=True)
            sys.exit(128 + e.signum)


def sweep_status(cfg: CompareConfig, base: TrainConfig, root: Path) -> str | None:
    """A line saying the sweep into root is still running (a compare.py holds its lock), or None."""
    if (holder := lock_holder(root)) is None:
        return None
    runs = sweep.plan(cfg, base, vocab_size_of(base.dataset) or 50304, root)
    return (f"The sweep is still running ({holder}): {sum(map(sweep.finished, runs))} of {len(runs)} runs "
            f"finished. This report shows those finished so far; make it again when the sweep ends.")


def main(config: tuple[CompareConfig, TrainConfig]) -> None:
    cfg, base = config
    if cfg.mode == "costs":
        costs(cfg, base)
        return
    root = Path(base.out_dir)
    if cfg.mode in ("train", "all", "plan"):
        train(cfg, base, root)
    if cfg.mode in ("report", "all"):
        text = report.write_report(root, cfg, base, sweep_status(cfg, base, root))
        print(f"{text}\nwrote {root / 'report.md'}, {root / 'report.csv'}, {root / 'report.png'}")


if __name__ == "__main__":
    run_cli(main, parse, keys=(CompareConfig, TrainConfig))
