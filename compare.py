r"""Compare attention variants: train MHA, GQA, MQA (and MLA) versions of one config over seeds
(and sizes, and MHA -> GQA/MQA/MLA conversions), then report what each costs and scores, with
intervals that tell a difference from noise.

    # sweep + report in the config's out_dir
    python compare.py config/compare/cpu.py --seeds=3
    # MLA beside them
    python compare.py config/compare/cpu.py --variants=[mha,gqa2,mqa,mla32] --match=params
    # each variant at its own best learning rate of three (chosen on val, reported on test)
    python compare.py config/compare/mqar.py --seeds=5 --lrs=[1e-3,3e-3,1e-2]
    # ... and a variant whose best is the lowest or highest of them at up to 2 rates further out
    python compare.py config/compare/mqar.py --seeds=5 --lrs=[1e-3,3e-3] --bracket=2
    # the runs and an estimated time, no training
    python compare.py config/compare/cpu.py --seeds=3 --mode=plan
    # also variants widened to MHA's parameters
    python compare.py config/compare/cpu.py --match=[width,params]
    # the GQA paper's conversion ablations
    python compare.py config/compare/cpu.py --convert=True --convert_methods=[mean,first,random] \
        --uptrain_fractions=[0,0.05,0.1]
    # each run also scored by lm-evaluation-harness: a report column per task (docs/benchmarks.md)
    python compare.py config/compare/cpu.py --seeds=3 --lm_eval=[next_line,hellaswag]
    # the report alone, from the runs' logs
    python compare.py config/compare/cpu.py --mode=report
    # parameters and KV-cache bytes of every n_kv_head
    python compare.py config/train_gpt2.py --mode=costs
    # a finished sweep on
    python compare.py config/compare/cpu.py --max_iters=480 --extend=True

Positional arguments and --key=value flags of train.py's TrainConfig describe the base run; the
keys below steer the comparison. Each run trains in <out_dir>/<variant>-s<seed> (sizes:
<n_layer>x<n_embd>-<variant>-s<seed>; --lrs: <variant>-lr<rate>-s<seed>) with wandb group
<out_dir name> and tags naming its variant, seed, size and rate. With --lrs, the report takes each
variant at the rate of lowest mean final val loss over its seeds, and gives every figure on the
dataset's test split, which that choice never saw.

Variant names (--variants) are lower case: mha, gqa<n_kv_head>, mqa, mla<kv_lora_rank>, each with
-<window_pattern><window> for local layers (mha-sl8 is train.py's --window_pattern=SL --window=8),
-<layer_pattern> for recurrent layers (mha-dddl, mha-kkkl), then -gate, -qknorm, -sink, -nope
(smallgpt/variant.py has the grammar).
The names decide what the base run leaves out: n_kv_head, kv_lora_rank, window, window_pattern and
MLA's other keys. Every run is checked before the first trains (its config, the dataset and
final_evals). A run trained before at another budget (max_iters, warmup_iters, lr_decay_iters,
decay_lr) is refused: resumed, it would change its learning-rate schedule midway; --extend=True
trains such runs on to the new budget from their checkpoints (the rate then follows the new
schedule). The report reads exactly the runs the command names and marks those trained for other
iterations than its budget. out_dir is taken only when new, empty or marked as a comparison by the
compare.json a sweep writes there.
"""

# configurator first: a Ctrl-C while torch imports is then one line, not a traceback
from configurator import build, given_values, parse_config, run_cli, split_args
from smallgpt.errors import UserError

# isort: split
import dataclasses
import json
import re
import sys
import time
from pathlib import Path

import torch

from model import GPT, GPTConfig, kind_names
from smallgpt import (
    choice_task,
    distillation,
    harness,
    rate_bracket,
    recall,
    report,
    runtime,
    sweep,
)
from smallgpt.atomic import (
    atomic_open,
    check_claimable,
    claim_folder,
    folder_lock,
    lock_holder,
    remove_stale_temps,
)
from smallgpt.checkpoint import check_vocabulary, parse_source
from smallgpt.configs import SOLVED_THRESHOLD, CompareConfig, TrainConfig, repeated
from smallgpt.convert import check_latent_target
from smallgpt.data import Batches, data_dir, load_meta, vocab_size_of
from smallgpt.measure import cached_step_throughput, default_kv_heads, table, training_seconds
from smallgpt.runlog import read_run
from smallgpt.runtime import Placement
from smallgpt.variant import MHA, Variant

# the MLA keys that a variant's name leaves at their defaults: the base run is not MLA
MLA_KEYS = ("qk_rope_head_dim", "q_lora_rank", "latent_norm")
# a run's budget and learning-rate schedule: resumed with others, it changes its schedule midway
SCHEDULE_KEYS = ("max_iters", "warmup_iters", "lr_decay_iters", "decay_lr")
# train.py keys that steer a conversion into a hybrid or its distillation: given to compare.py,
# they go to its conversion runs alone (the runs from scratch convert nothing)
CONVERSION_KEYS = ("convert_layers", "convert_calibrate", "distill_ce", "teacher")
# train.py keys that say where a run is written, logged and how it is run, not what it trains or
# measures: a run trained before with other values of these is still the sweep's run (the dataset
# is compared by its meta, checkpoint_of; init_from names the folders, which may have moved)
WHERE_KEYS = (
    "out_dir",
    "init_from",
    "dataset",
    "eval_interval",
    "eval_at_start",
    "eval_only",
    "log_interval",
    "always_save_checkpoint",
    "keep_last",
    "wandb_log",
    "wandb_project",
    "wandb_run_name",
    "wandb_group",
    "wandb_tags",
    "device",
    "dtype",
    "compile",
    "parallel",
    "peak_flops",
)

# What compare.py writes at the root of a comparison (beside its runs' folders); the first marks it
# (smallgpt/atomic.py's KIND_MARKERS: a folder is the comparison's only when it holds that one)
COMPARISON_FILES = ("compare.json", report.SPEED_FILE, "report.md", "report.csv", "report.png")
COMPARISON_TEMPS = "|".join(map(re.escape, COMPARISON_FILES))  # those written through a temp file


def timings(
    runs: list[sweep.Run], base: TrainConfig, place: Placement
) -> dict[tuple, tuple[float, float]]:
    """Each shape's seconds per training step and per evaluation batch (measure.training_seconds: 5
    timed steps)."""
    shapes = {r.shape: r.model for r in runs}
    return {
        k: training_seconds(m, base.batch_size, base.optimizer, place) for k, m in shapes.items()
    }


def show_plan(
    runs: list[sweep.Run], times: dict[tuple, tuple[float, float]], base: TrainConfig, device: str
) -> str:
    """The runs a sweep makes, their tokens and estimated times, and the total."""
    waiting = [r for r in runs if not sweep.finished(r)]
    rows = [
        {
            "run": r.dir.name,
            "iters": r.iters,
            "tokens": r.iters * r.tokens_per_iter,
            "estimated s": round(sweep.estimated_seconds(r, times, base.eval_iters)),
            "state": "to run" if r in waiting else "finished",
        }
        for r in runs
    ]
    todo = sum(sweep.estimated_seconds(r, times, base.eval_iters) for r in waiting)
    text = (
        f"{table(rows)}\n\n{len(runs)} runs, {len(waiting)} to run: about {sweep.clock(todo)} on "
        f"{device} (5 timed training steps and 3 evaluation batches per shape, plus "
        f"{sweep.STARTUP_S:.0f} s per run to start train.py), plus the decode-speed measurement"
    )
    print(text)
    return text


def measure_speeds(cfg: CompareConfig, runs: list[sweep.Run], root: Path, device: str) -> None:
    """The cached-step decode speed on device of each shape not measured yet, speed_repeats times
    interleaved over the shapes (so drift on a shared machine spreads over all of them), into
    root/speed.json with the settings they were measured with (report.speed_settings): speeds
    stored with other settings (another machine, device or torch) are measured again, all."""
    path = root / report.SPEED_FILE
    settings = report.speed_settings(cfg, device)
    stored = report.read_speeds(root)
    by_shape = stored.by_shape
    if by_shape and stored.settings != settings:
        was = stored.settings or {}
        changed = [
            f"{k} {was.get(k, 'not recorded')!r} -> {v!r}"
            for k, v in settings.items()
            if was.get(k) != v
        ]
        print(
            f"{path} holds decode speeds measured with other settings ({'; '.join(changed)}): "
            f"measuring every shape again",
            flush=True,
        )
        by_shape = {}
    shapes = {}
    for r in runs:
        shapes[report.speed_key(r.model, cfg.decode_context, cfg.decode_batch)] = r.model
    todo = {k: m for k, m in shapes.items() if len(by_shape.get(k, [])) < cfg.speed_repeats}
    if not todo:
        return
    print(
        f"decode speed of {len(todo)} shapes, batch {cfg.decode_batch} at {cfg.decode_context} "
        f"positions, {cfg.speed_repeats} repeats ...",
        flush=True,
    )
    t0 = time.perf_counter()
    fresh = {k: [] for k in todo}
    for _ in range(cfg.speed_repeats):
        for k, m in todo.items():
            tok_s = cached_step_throughput(
                m, cfg.decode_batch, cfg.decode_context, cfg.decode_steps, device
            )
            fresh[k].append(tok_s)
    with atomic_open(path, "w") as f:
        json.dump({"measured_with": settings, "speeds": by_shape | fresh}, f, indent=1)
    print(f"measured in {time.perf_counter() - t0:.0f} s: {path}")


def costs(cfg: CompareConfig, base: TrainConfig) -> str:
    """Parameters and KV-cache bytes for every n_kv_head that divides n_head and each MLA or
    windowed variant of --variants (no training)."""
    vocab = vocab_size_of(base.dataset) or 50304  # GPT-2's, padded
    mha = sweep.mha_config(base, vocab)
    # every n_kv_head that divides n_head, then the MLA and windowed variants of --variants
    divisors = sorted({d for d in range(1, base.n_head + 1) if base.n_head % d == 0}, reverse=True)
    models = [dataclasses.replace(mha, n_kv_head=g) for g in divisors]
    for variant in map(Variant.parse, cfg.variants):
        if variant.attention == "mla" or variant.suffix:
            models.append(variant.config(mha))
    rows = []
    for mcfg in models:
        with torch.device("meta"):
            model = GPT(mcfg)
        kv = mcfg.kv_cache_bytes(1, mcfg.block_size, getattr(torch, cfg.kv_dtype))
        kv_column = f"KV cache/sequence @ {mcfg.block_size} ({cfg.kv_dtype}, MiB)"
        kind = mcfg.attention_label  # 'none' where no layer attends
        if kind == "MLA":
            kind += f" (kv_lora_rank={mcfg.kv_lora_rank})"
        if mcfg.window:
            kind += f", window {mcfg.window} in {mcfg.layer_letters}"
        if mcfg.recurrent_layers:  # the kinds that do not attend, by name
            letters = sorted({mcfg.layer_letters[i] for i in mcfg.recurrent_layers})
            kind += f", {kind_names(letters)} in {mcfg.layer_letters}"
        rows.append(
            {
                "n_kv_head": mcfg.n_kv_head if mcfg.attends else "-",
                "kind": kind,
                "params (M)": round(model.num_params() / 1e6, 2),
                # a hybrid's: the mean of its attention and recurrent layers'
                "attention params/layer": round(model.mixing_params() / mcfg.n_layer),
                kv_column: round(kv / 2**20, 2),
            }
        )
    text = table(rows)
    print(text)
    return text


def check_base_keys(given: dict) -> None:
    """A UserError for a key given to the base run that the variants' names decide (K/V heads,
    MLA, local layers) or that only MLA takes: it names the key, and how a comparison says it."""
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    changed = {k: v for k, v in given.items() if v != defaults.get(k)}
    if "n_kv_head" in changed:
        n_kv_head = changed["n_kv_head"]
        heads = sorted({given.get("n_head", defaults["n_head"]), n_kv_head}, reverse=True)
        raise UserError(
            f"n_kv_head={n_kv_head} in the base run: compare.py gives each variant "
            f"its K/V heads by name (mha, gqa<n_kv_head>, mqa) or by --kv_heads, "
            f"e.g. --kv_heads=[{','.join(map(str, heads))}]; leave n_kv_head out"
        )
    if "convert_method" in changed:
        raise UserError(
            f"convert_method={changed['convert_method']!r} in the base run: compare.py converts "
            f"with --convert=True by each of --convert_methods, e.g. --convert_methods=[mean,"
            f"first]; leave convert_method out"
        )
    if "kv_lora_rank" in changed:
        rank = changed["kv_lora_rank"]
        raise UserError(
            f"kv_lora_rank={rank} in the base run: compare.py makes MLA a variant "
            f"of its own, named mla<kv_lora_rank>, e.g. --variants=[mha,mla{rank}]; "
            f"leave kv_lora_rank out"
        )
    for key in ("window", "window_pattern"):
        if key in changed:
            pattern = str(given.get("window_pattern", "SL")).lower()
            if "s" not in pattern or not set(pattern) <= {"s", "l"}:
                pattern = "sl"
            example = f"mha-{pattern}{given.get('window') or 64}"
            raise UserError(
                f"{key}={changed[key]!r} in the base run: compare.py gives each "
                f"variant its local layers by name, e.g. --variants=[mha,{example}] "
                f"(lower case); leave window and window_pattern out"
            )
    for key in MLA_KEYS:
        if key in changed:
            raise UserError(
                f"{key}={changed[key]!r} is an MLA key, and compare.py's base run, "
                f"which every variant starts from, is not MLA (its mla<kv_lora_rank> "
                f"variants are, with MLA's defaults): leave {key} out"
            )


def check_variants(
    cfg: CompareConfig, base: TrainConfig, variants: list[Variant], key: str
) -> None:
    """Each variant a valid model at each size, no two of them one model, each named as what it
    is (gqa<n_head> is mha), each MLA conversion possible: else a UserError naming the variant."""
    listed = f"{key}={getattr(cfg, key)}"
    for _, sbase in sweep.sizes(cfg.sizes, base):
        size = f"{sbase.n_layer}x{sbase.n_embd}"
        mha = sweep.mha_config(sbase, 1)
        models = {}
        seen = {}  # what tells one variant's model from another's -> the first variant that gave it
        for variant in variants:
            try:
                models[variant] = variant.config(mha)
            except ValueError as e:
                raise UserError(f"{listed} at {size}: {e}") from e
            model = models[variant]
            sweep.check_kinds_imported(model, f"{listed}: {variant}")  # kinds its train.py knows
            shape = (
                model.n_kv_head,
                model.kv_lora_rank,
                model.layers,  # each layer's kind, window and positions
                model.attn_gate,
                model.qk_norm,
                model.rope_fraction,
                model.attn_sinks,
            )
            other = seen.setdefault(shape, variant)
            if other != variant:
                windows = f", layer windows {model.layer_windows}" if model.window else ""
                raise UserError(
                    f"{listed}: {other} and {variant} are the same model at {size} "
                    f"({model.attention_type}, {model.kv_label}{windows}): list one of "
                    f"them"
                )
        for variant, model in models.items():
            canonical = Variant.from_config(model)
            if canonical != variant:
                raise UserError(
                    f"{listed}: {variant} is {canonical} at n_head={model.n_head}: name it "
                    f"{canonical}"
                )
            # and each MLA conversion possible
            if cfg.convert and model.attention_type == "MLA":
                try:
                    check_latent_target(model)
                except UserError as e:
                    raise UserError(f"convert=True to {variant} at {size}: {e}") from e


def parse(argv: list[str]) -> tuple[CompareConfig, TrainConfig]:
    ours, train_args = split_args(argv, CompareConfig)
    # train.py's flags that steer a conversion go to the conversion runs alone
    steering = [a for a in train_args if a[2:].split("=", 1)[0] in CONVERSION_KEYS]
    train_args = [a for a in train_args if a not in steering]
    cfg = parse_config(CompareConfig, ours)
    cfg = dataclasses.replace(cfg, train_args=train_args, conversion_args=steering)
    given_train = given_values(TrainConfig, train_args)
    check_base_keys(given_train)
    base = build(TrainConfig, given_train)
    if not cfg.variants:
        cfg.kv_heads = cfg.kv_heads or default_kv_heads(base.n_head)
    key = "variants" if cfg.variants else "kv_heads"
    listed = f"{key}={getattr(cfg, key)}"
    mha = sweep.mha_config(base, 1)
    try:
        variants = sweep.compared_variants(cfg, mha)
    except ValueError as e:  # K/V heads that n_head cannot have
        raise UserError(f"{listed}: {e}") from e
    # the keys that steer conversions, given without any
    given = given_values(CompareConfig, ours)
    uptraining = ("convert_methods", "uptrain_fractions", "uptrain_lr_scale", "uptrain_distill")
    steer = [k for k in uptraining if k in given]
    if steer and not cfg.convert:
        raise UserError(
            f"{', '.join(steer)} given without --convert=True: add it to convert, or drop them"
        )
    check_conversion_keys(cfg, given_values(TrainConfig, steering))
    if cfg.convert and cfg.lrs:
        raise UserError(
            f"convert=True with lrs={cfg.lrs}: a conversion uptrains the MHA run of one learning "
            "rate; convert in a sweep without --lrs (its rate: --learning_rate)"
        )
    if cfg.muon_lrs and base.optimizer != "muon":
        raise UserError(
            f"muon_lrs={cfg.muon_lrs} with optimizer={base.optimizer!r}: Muon's rates need "
            "--optimizer=muon; leave muon_lrs out"
        )
    if cfg.convert and MHA not in variants:
        held = f"n_head={base.n_head}" if key == "kv_heads" else "mha"
        raise UserError(f"convert=True converts the MHA runs: {listed} must hold {held}")
    if cfg.convert:
        check_conversions(variants, listed, "convert_methods" in given)
        check_hybrid_keys(variants, mha, given_values(TrainConfig, steering))
    if "params" in cfg.match and set(variants) == {MHA}:
        raise UserError(
            f"match={cfg.match}: params widens each variant's MLP to MHA's parameters, and "
            f"{listed} holds MHA alone (trained at its own width): add a variant, or leave "
            f"params out"
        )

    same = repeated([round(f * base.max_iters) for f in cfg.uptrain_fractions])
    if cfg.convert and same is not None:
        raise UserError(
            f"uptrain_fractions={cfg.uptrain_fractions} give {same} of max_iters={base.max_iters} "
            f"iterations twice: the same uptraining twice; give fractions 1/{base.max_iters} "
            f"apart or more"
        )
    check_variants(cfg, base, variants, key)
    return cfg, base


def unread(keys: list[str], why: str, fix: str) -> UserError:
    """The refusal of keys that steer what no run of the sweep does: '<keys> steer <why>: add
    <fix>, or leave <keys> out'."""
    names = ", ".join(keys)
    verb = "steers" if len(keys) == 1 else "steer"
    return UserError(f"{names} {verb} {why}: add {fix}, or leave {names} out")


def check_conversion_keys(cfg: CompareConfig, given: dict) -> None:
    """train.py's keys that steer a conversion (CONVERSION_KEYS, given) reach a run that reads
    them: a conversion, and for the teacher's keys one that distills; a UserError otherwise."""
    if given and not cfg.convert:
        raise unread(
            list(given), "train.py's conversions and this sweep converts nothing", "--convert=True"
        )
    distilling = [k for k in ("teacher", "distill_ce") if k in given]
    if distilling and not cfg.uptrain_distill:
        raise unread(
            distilling,
            "a distillation and the conversions uptrain on the data alone",
            "--uptrain_distill=logits",
        )
    if cfg.uptrain_distill and not any(cfg.uptrain_fractions):
        raise UserError(
            f"uptrain_distill={cfg.uptrain_distill!r} distills while uptraining, and "
            f"uptrain_fractions={cfg.uptrain_fractions} uptrain nothing: add a fraction above "
            f"0, or leave uptrain_distill out"
        )


def check_hybrid_keys(variants: list[Variant], mha: GPTConfig, given: dict) -> None:
    """convert_layers and convert_calibrate (in given) steer a conversion into a hybrid: a
    UserError where the sweep converts into none."""
    keys = [k for k in ("convert_layers", "convert_calibrate") if k in given]
    hybrids = [
        v for v in variants if sweep.converted_from_mha(v) and v.config(mha).recurrent_layers
    ]
    if keys and not hybrids:
        named = ", ".join(keys)
        verb = "steers" if len(keys) == 1 else "steer"
        raise UserError(
            f"{named} {verb} the conversion into a hybrid, and no variant converted is one: add "
            f"a hybrid, e.g. mha-dl, or leave {named} out"
        )


def check_conversions(variants: list[Variant], listed: str, methods_given: bool) -> None:
    """What --convert=True would convert (sweep.conversion_runs: MHA into each variant
    sweep.converted_from_mha) is something, and --convert_methods (given: methods_given) reaches
    one of them: a UserError where either would do nothing."""
    targets = [v for v in variants if sweep.converted_from_mha(v)]
    if not targets:
        raise UserError(
            f"convert=True converts MHA into the variants of all-global attention (gqa<n_kv_head>, "
            f"mqa, mla<kv_lora_rank>) and hybrids of it (mha-dddl, gqa2-dl), and {listed} has none "
            f"besides mha (local and gated variants train from scratch only): add one, e.g. gqa2, "
            f"or leave convert out"
        )
    if methods_given and all(v.attention in ("mla", "mha") for v in targets):
        raise UserError(
            f"convert_methods pool K/V heads for gqa and mqa targets, and {listed} converts only "
            f"to MLA (by SVD: convert.to_latent) or MHA hybrids (copied): leave convert_methods out"
        )


def check_runs(cfg: CompareConfig, base: TrainConfig, runs: list[sweep.Run]) -> None:
    """Before any work: each run's train.py config as train.py reads it (its model's own checks
    too), what the dataset takes (its examples' length, the vocabulary, final_evals), the
    budgets of the runs trained already (check_budgets) and the harness's tasks of --lm_eval; a
    UserError naming the run and the key."""
    data = data_dir(base.dataset)
    meta = None
    if (data / "meta.json").is_file():  # a plan needs no data
        batches = Batches(data, base.block_size, base.batch_size, base.seed, "cpu")  # as runs do
        meta = batches.meta
    planned = {}
    for run in runs:
        try:
            planned[run.dir] = parse_config(TrainConfig, [*run.args, f"--out_dir={run.dir}"])
            if meta is not None:
                check_vocabulary(run.model.vocab_size, meta, None, base.dataset)
        except UserError as e:
            raise UserError(f"{run.dir.name}: {e}") from e
        final_evals = planned[run.dir].final_evals
        try:
            if meta is not None:
                recall.check_dataset(final_evals, meta, planned[run.dir].block_size, str(data))
        except UserError as e:
            raise UserError(f"{run.dir.name}: final_evals={final_evals}: {e}") from e
    check_budgets(cfg, runs, planned, meta, base.dataset)
    if cfg.lm_eval and cfg.mode != "plan":
        check_benchmarks(cfg.lm_eval)


def check_budgets(
    cfg: CompareConfig,
    runs: list[sweep.Run],
    planned: dict[Path, TrainConfig],
    meta: dict | None,
    dataset: str,
) -> None:
    """Refuse a run trained before with other settings (check_same_settings), and to resume one
    trained at another budget (SCHEDULE_KEYS) unless --extend=True asks for it: it would change
    its learning-rate schedule midway (the rate rises again) and the report set it beside runs of
    another budget. With extend, refuse what extending cannot do: shorten a run, or keep the
    conversions made of a model it trains on."""
    changed = {}  # a run's folder -> its checkpoint's schedule keys that differ from the plan's
    trained_to = {}  # ... -> its checkpoint's iteration
    for run in runs:
        stored = checkpoint_of(run, meta, dataset)
        if stored is None:
            continue
        now = planned[run.dir]
        check_same_settings(run, stored, now)
        was = {
            k: v for k, v in stored["config"].items() if k in SCHEDULE_KEYS and v != getattr(now, k)
        }
        if was:
            changed[run.dir] = was
            trained_to[run.dir] = stored["iter_num"]
    if not changed:
        return
    if not cfg.extend:
        raise UserError(other_budget(changed, planned))
    check_extension(runs, planned, changed, trained_to)


def check_same_settings(run: sweep.Run, stored: dict, now: TrainConfig) -> None:
    """A run trained before is the sweep's run only where it was trained as this command trains it:
    its model (stored: sweep.trained's record), and its training keys but its budget
    (SCHEDULE_KEYS, which --extend may change) and WHERE_KEYS; else a UserError naming the keys
    (resumed or counted finished, it would sit beside runs of other settings in the report)."""
    model_keys = {f.name for f in dataclasses.fields(GPTConfig)}
    ignored = {*SCHEDULE_KEYS, *WHERE_KEYS, *model_keys}
    planned = json.loads(json.dumps(dataclasses.asdict(now)))  # as a checkpoint holds it
    was = {k: v for k, v in stored["config"].items() if k in planned and k not in ignored}
    asked = {k: planned[k] for k in was}
    # what a run sets for itself is not a setting it was given: its teacher, the convert: source
    # unless --teacher names another (both sides as that source, which may have moved)
    if "teacher" in was:
        was["teacher"] = own_teacher(stored["config"])
        asked["teacher"] = own_teacher(planned)
    # the model as the plan resolves it (its MLP, vocabulary), against the checkpoint's
    was |= stored["model_config"]
    asked |= dataclasses.asdict(run.model)
    differ = [k for k in asked if k in was and was[k] != asked[k]]
    if differ:
        trained = ", ".join(f"{k}={was[k]!r}" for k in differ)
        wanted = ", ".join(f"{k}={asked[k]!r}" for k in differ)
        raise UserError(
            f"{run.dir.name} was trained with {trained}, and this sweep asks {wanted}: its runs "
            f"would sit beside runs of other settings; use another out_dir, or give the "
            f"settings the runs were trained with"
        )


def own_teacher(config: dict) -> str:
    """A run config's teacher as train.py records it (distillation.planned_teacher), its
    convert: source written as that, so that the same run in a moved folder is the same."""
    teacher = config.get("teacher", "")
    source = parse_source(config.get("init_from", "scratch"))
    if config.get("distill"):
        teacher = distillation.planned_teacher(config["distill"], teacher, source)
    if teacher and source.kind == "convert" and teacher == source.where:
        return "<its convert: source>"
    return teacher


def checkpoint_of(run: sweep.Run, meta: dict | None, dataset: str) -> dict | None:
    """What run's checkpoint was trained as (sweep.trained; None without one), refused where the
    dataset (its meta) was prepared again since the run trained: with other tokens, or otherwise
    (other splits, or other settings where both metas record them)."""
    stored = sweep.trained(run)
    if stored is None or meta is None:
        return stored
    try:
        check_vocabulary(run.model.vocab_size, meta, stored["data_meta"], dataset)
    except UserError as e:
        raise UserError(f"{run.dir.name}: {e}") from e
    trained_on = stored["data_meta"] or {}
    keys = ["train_tokens", "val_tokens", "test_tokens"]
    if "settings" in trained_on and "settings" in meta:
        keys.append("settings")
    differ = [k for k in keys if trained_on.get(k) != meta.get(k)]
    if differ:
        was = ", ".join(f"{k}={trained_on.get(k)!r}" for k in differ)
        raise UserError(
            f"{run.dir.name} was trained on dataset {dataset} as it was prepared before ({was}), "
            f"not as it is now: use another out_dir, or prepare the dataset as it was"
        )
    return stored


def other_budget(changed: dict[Path, dict], planned: dict[Path, TrainConfig]) -> str:
    """Why the runs of changed (folder -> their checkpoints' schedule keys that differ from the
    plan's) are not resumed without --extend=True."""
    first = next(iter(changed))
    was = ", ".join(f"{k}={v}" for k, v in changed[first].items())
    now = ", ".join(f"{k}={getattr(planned[first], k)}" for k in changed[first])
    who = f"{first.name} has a checkpoint"
    if len(changed) > 1:
        who = f"{first.name} and {len(changed) - 1} other runs have checkpoints"
    return (
        f"{who} of another budget ({first.name}: {was}; this sweep: {now}): "
        f"resumed, a run would change its learning-rate schedule midway, and the "
        f"report would set it beside runs of another budget; use another out_dir, "
        f"or --extend=True to train such runs on to this budget"
    )


def check_extension(
    runs: list[sweep.Run],
    planned: dict[Path, TrainConfig],
    changed: dict[Path, dict],
    trained_to: dict[Path, int],
) -> None:
    """What --extend=True cannot do with the runs of changed: shorten one (trained_to: each one's
    checkpoint's iteration), or keep the conversions made of a model it trains on."""
    for folder, iters in trained_to.items():
        if iters > planned[folder].max_iters:
            raise UserError(
                f"extend=True trains runs on, and {folder.name} is at iteration "
                f"{iters}, past max_iters={planned[folder].max_iters}: use another "
                f"out_dir for a shorter budget"
            )
    stale = []  # the conversions of a model that extend would train on
    for run in runs:
        source = parse_source(planned[run.dir].init_from)
        converted = source.kind == "convert" and Path(source.where) in changed
        if converted and (run.dir / "log.jsonl").exists():
            stale.append(run.dir.name)
    if stale:
        raise UserError(
            f"extend=True trains on the models that {', '.join(stale)} converted at "
            f"their old budget: delete those folders, and the sweep converts the "
            f"models trained on"
        )


def train(cfg: CompareConfig, base: TrainConfig, root: Path) -> None:
    """The sweep (or, with mode 'plan', what it would run). SIGTERM or SIGINT stops it cleanly: its
    train.py saves and ends, one line says where the sweep stopped, and it exits 143 or 130; run the
    same command to resume."""
    vocab = vocab_size_of(base.dataset)
    if vocab is None and cfg.mode != "plan":
        # a sweep stops here: the missing dataset's one-line error
        load_meta(data_dir(base.dataset))
    # a plan needs no data: GPT-2's padded vocabulary stands in
    runs = rate_bracket.plan(cfg, base, vocab or 50304, root)
    # before any work: a run that cannot train, or would mix budgets; harness tasks out of reach
    check_runs(cfg, base, runs)
    say_what_is_not_compared(cfg, base)
    say_where_solved_is_at_the_stop(cfg, base)
    with sweep.Stop() as stop:
        try:
            # the device and dtype, as each run's train.py decides them
            place = runtime.place(base.device, base.dtype, base.n_embd)
            # the shapes to time for the estimate: a plan's every run, a sweep's runs left
            timed = runs if cfg.mode == "plan" else [r for r in runs if not sweep.finished(r)]
            times = timings(timed, base, place)
            if cfg.mode == "plan":
                show_plan(runs, times, base, place.device)
                if cfg.bracket:
                    print(
                        f"bracket={cfg.bracket}: then, for each variant whose best rate is the "
                        "lowest or highest it trained at, all its seeds at a rate one grid step "
                        f"further out, up to {cfg.bracket} times (decided as the runs finish)"
                    )
                return
            # one sweep in a folder at a time (each run locks its own too)
            with folder_lock(root, "compare.py"):
                # what a killed compare.py left half-written
                remove_stale_temps(root, COMPARISON_TEMPS)
                # the folder is the comparison's from here on (compare.json)
                claim_folder(root, "a comparison", {"command": sys.argv})
                sweep.launch_all(runs, times, base.eval_iters, stop)
                runs += train_past_edges(cfg, base, root, runs, place, stop)
                stop.where = "while measuring the decode speeds"
                measure_speeds(cfg, runs, root, place.device)
                score_runs(cfg, base, runs, stop)
        except sweep.Stopped as e:
            finished = sum(map(sweep.finished, runs))
            print(
                f"{e}: {finished} of {len(runs)} runs finished; run the same command again to "
                f"resume (a run cut short goes on from its checkpoint)",
                file=sys.stderr,
                flush=True,
            )
            sys.exit(128 + e.signum)


def say_what_is_not_compared(cfg: CompareConfig, base: TrainConfig) -> None:
    """A line up front where the sweep has no MHA to set the variants beside, and one naming the
    variants that convert=True trains from scratch only."""
    mha = sweep.mha_config(base, 1)
    if MHA not in sweep.compared_variants(cfg, mha):
        key = "variants" if cfg.variants else "kv_heads"
        add = "mha" if cfg.variants else base.n_head
        print(
            f"no MHA in {key}={getattr(cfg, key)} (n_head={base.n_head}): the report compares "
            f"these variants but shows no difference to MHA; add {add} to {key} for that",
            flush=True,
        )
    if cfg.convert:
        compared = sweep.compared_variants(cfg, mha)
        scratch_only = [str(v) for v in compared if v != MHA and not sweep.converted_from_mha(v)]
        if scratch_only:
            print(
                f"convert=True: {', '.join(scratch_only)} train from scratch only (a conversion "
                f"makes all-global attention of MHA's, and hybrids of it)",
                flush=True,
            )


def say_where_solved_is_at_the_stop(cfg: CompareConfig, base: TrainConfig) -> None:
    """A line up front where a run stops early on reaching solved_threshold or less: a run that
    stops there has only just reached it, on val, so whether its test split counts it solved is
    the splits' noise (a seed stopped at 0.99 on val measured 0.989 on test)."""
    stop = base.stop_at_accuracy
    if stop is not None and cfg.solved_threshold >= stop:
        print(
            f"solved_threshold={cfg.solved_threshold} is at or above stop_at_accuracy={stop}: a "
            f"run stops as soon as its val accuracy reaches {stop}, so whether its test accuracy "
            f"counts it solved is the splits' noise; give a solved_threshold below it (the "
            f"default is {SOLVED_THRESHOLD})",
            flush=True,
        )


def train_past_edges(
    cfg: CompareConfig,
    base: TrainConfig,
    root: Path,
    runs: list[sweep.Run],
    place: Placement,
    stop: sweep.Stop,
) -> list[sweep.Run]:
    """--bracket's runs past an edge of the rates beyond runs (all finished), trained one step at a
    time as the runs before decide them (rate_bracket.plan)."""
    known = {r.dir for r in runs}
    added = []
    vocab = vocab_size_of(base.dataset)
    while more := [r for r in rate_bracket.plan(cfg, base, vocab, root) if r.dir not in known]:
        check_runs(cfg, base, more)
        print(f"{len(more)} runs past an edge of the rates (bracket)", flush=True)
        sweep.launch_all(more, timings(more, base, place), base.eval_iters, stop)
        known |= {r.dir for r in more}
        added += more
    return added


def check_benchmarks(tasks: list[str]) -> None:
    """A UserError, before any training, where the runs could not be scored on tasks (--lm_eval):
    lm-eval not installed, a task it does not know, or its data out of reach. The project's own
    (lines, next_line) are made from each run's dataset when it is scored."""
    harness.check_installed()
    others = [t for t in tasks if t not in choice_task.TASKS]
    if others:
        harness.check_reachable(harness.resolve(others, None))


def score_runs(
    cfg: CompareConfig, base: TrainConfig, runs: list[sweep.Run], stop: sweep.Stop
) -> None:
    """eval.py --lm_eval on each finished run not yet scored on every task of cfg.lm_eval at
    cfg.lm_eval_limit (its log's benchmarks record), one after another; a run that diverged has
    nothing to score."""
    if not cfg.lm_eval:
        return
    todo = []
    for run in runs:
        logged = read_run(run.dir)
        scored = logged["benchmarks"]
        done = all(cfg.lm_eval_limit in scored.get(t, {}) for t in cfg.lm_eval)
        if not logged["diverged"] and not done:
            todo.append(run)
    eval_py = Path(__file__).resolve().parent / "eval.py"
    for i, run in enumerate(todo, 1):
        args = [
            f"--out_dir={run.dir}",
            f"--lm_eval=[{','.join(cfg.lm_eval)}]",
            f"--device={base.device}",
            "--progress=False",
        ]
        if cfg.lm_eval_limit is not None:
            args.append(f"--lm_eval_limit={cfg.lm_eval_limit}")
        print(f"$ python eval.py {' '.join(args)}  # [{i}/{len(todo)}]", flush=True)
        stop.where = f"while scoring {run.dir} (lm_eval)"
        if stop.wait([sys.executable, str(eval_py), *args]):
            raise UserError(f"eval.py --lm_eval on {run.dir} failed: see its output above")
    stop.where = "after scoring"


def unmarked_sweep_hint(root: Path) -> str:
    """For a folder refused as not a comparison: how to adopt one that a sweep made before sweeps
    marked their folders (it holds runs' logs), or nothing."""
    if not root.is_dir() or not any(root.glob("*/log.jsonl")):
        return ""
    marker = root / COMPARISON_FILES[0]
    return (
        f"; if it is a sweep of yours from before compare.py marked its folders, mark it: "
        f'echo \'{{"kind": "a comparison"}}\' > {marker}'
    )


def sweep_status(runs: list[sweep.Run], root: Path) -> str | None:
    """A line saying the sweep of runs into root is still running (a compare.py holds its lock),
    or None."""
    holder = lock_holder(root)
    if holder is None:
        return None
    finished = sum(map(sweep.finished, runs))
    return (
        f"The sweep is still running ({holder}): {finished} of {len(runs)} runs finished. This "
        f"report shows those finished so far; make it again when the sweep ends."
    )


def main(config: tuple[CompareConfig, TrainConfig]) -> None:
    cfg, base = config
    if cfg.mode == "costs":
        costs(cfg, base)
        return
    root = Path(base.out_dir)
    if cfg.mode != "plan":
        # before any work: a folder compare.py made (compare.json), or an empty or new one
        try:
            check_claimable(root, "a comparison")
        except UserError as e:
            raise UserError(f"{e}{unmarked_sweep_hint(root)}") from None
        # and the decode speeds it keeps there readable (a sweep would merge its own into them)
        report.read_speeds(root)
    if cfg.mode in ("train", "all", "plan"):
        train(cfg, base, root)
    if cfg.mode in ("report", "all"):
        # the runs this command names: its variants, seeds, sizes, rates and conversions
        runs = rate_bracket.plan(cfg, base, vocab_size_of(base.dataset) or 50304, root)
        text = report.write_report(root, cfg, base, runs, sweep_status(runs, root))
        print(f"{text}\nwrote {root / 'report.md'}, {root / 'report.csv'}, {root / 'report.png'}")


if __name__ == "__main__":
    run_cli(main, parse, keys=(CompareConfig, TrainConfig))
