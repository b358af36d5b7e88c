"""Why MLA at full rank fails MQAR where MHA solves it: train.py on data/mqar at 2x128 (the README's
MQAR setting, config/compare/mqar.py) for each setting below over seeds, then one table of the runs
that solved it (MQAR accuracy >= 0.9 on the test split), with the Clopper-Pearson interval, and the
mean final test loss. docs/compare.md "MLA on MQAR, diagnosed" has the figures.

    python data/mqar/prepare.py
    python scripts/mla_mqar_ablation.py --seeds=3 [--settings=[mha,mla128]] [--out=DIR]
    # where the MHA -> MLA conversion's loss comes from, on a trained MHA run's test split
    python scripts/mla_mqar_ablation.py --conversion=out-mla-ablation/mha-s1337

Six settings change what no key of train.py changes. Each names by --layer_pattern a kind of layer
this script defines (KINDS, beside attention.LatentAttention) and registers (model.register_kind,
kinds_registered) in the process that trains it, the script itself run with --one=: kinds, not
patches of other modules. `mla128-rope-per-head` (P) gives each head its own rotary key (kv_a makes
n_head of them instead of DeepSeek's one shared), as does `mla128-holds-mha` (with a rotary key as
wide as MHA's and no latent norm: MHA is one of its functions); `mla128-one-map` (O) makes K's NoPE
features and V from x by one matrix (kv_x), no latent, `-head-scale` (H) with MHA's softmax scale,
`-all-rotary` (R) with the NoPE features rotated too; `mla128-latent-adamw` (A) leaves the latent
maps (kv_a, kv_b) to AdamW while Muon takes the other matrices. `mha-half-rotary` is
--rope_fraction=0.5, which computes what the patch it once was did (a test checks it).

Those runs' checkpoints record layer_pattern=<its letter>: loading one (sample.py, eval.py, a
resume) needs the kind registered first (this module's kinds_registered()), else it is refused in
one line. This script loads none without them: its summary and its reuse check read the runs' logs
(and a checkpoint's dataset meta, building no model), and --conversion registers them before it
loads a run.

Every mistake is one line before the first run: each key (a setting it does not have, one listed
twice), each setting's train.py config, data/mqar (missing, or not of the config's examples), and a
--conversion run that is not a rotary MHA one. --out is taken only when new, empty or made by this
script (its ablation.json marks it; the runs in it are train.py's own folders). A run that fails
ends the script with that run's exit status, after its own line.
"""

import dataclasses
import difflib
import json
import os
import runpy
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from attention import READS, LatentAttention, apply_rope, rope_tables, rows_spec
from configurator import parse_config, run_cli
from kv_cache import Cache, RowsSpec
from layer_kind import Config, LayerKind, Mask, Rope
from model import LAYER_KINDS, register_kind
from smallgpt import recall
from smallgpt.atomic import check_claimable, claim_folder
from smallgpt.checkpoint import load_checkpoint
from smallgpt.configs import TrainConfig, repeated
from smallgpt.data import Batches, data_dir
from smallgpt.errors import UserError
from smallgpt.fast_paths import Linear, sdpa
from smallgpt.runlog import read_run

ROOT = Path(__file__).resolve().parent.parent
ARGS = "SMALLGPT_ABLATION_ARGS"  # train.py's arguments for a --one= process (JSON)
KIND = "an MLA ablation"  # smallgpt/atomic.py's kind: ablation.json marks the out folder
FIRST_SEED = 1337  # the runs' seeds: FIRST_SEED, FIRST_SEED + 1, ...


# ---- the settings no key of train.py makes: kinds of layer, registered where they are used ----


class AblationKind(LayerKind):
    """What the script's kinds declare alike: MLA's keys read (each kind is MLA changed), no
    export, no fixed-shape step."""

    attends = True
    reads = READS
    static_step = "a training ablation's kind: its forward is a full one, with no cached step"
    hf_layer_type = None  # no transformers class holds it: export refuses it in one line

    @classmethod
    def problems(cls, config: Config) -> list[str]:
        # MLA's latent and rotary key are what these kinds change
        if cls.letter in config.layer_letters and (
            config.kv_lora_rank is None or config.pos_encoding != "rope"
        ):
            return [
                f"layer_pattern={config.layer_letters!r}: {cls.name} ({cls.letter}) is MLA with "
                "rotary positions: set kv_lora_rank and pos_encoding='rope'"
            ]
        return []

    @classmethod
    def cache_spec(cls, config: Config) -> RowsSpec:
        # what a cache would keep of the K and V its forward builds: each head's (its forward
        # refuses a cache, but GPTConfig.kv_cache_bytes and make_kv_cache ask)
        return RowsSpec(config.n_head, config.head_dim + config.rope_dim, config.head_dim)


class ChangedLatentAttention(LatentAttention):
    """LatentAttention changed for a training ablation, its forward a full one (a cache is refused
    in one line): K's NoPE features and V, and the rotary keys (one shared, or one a head), come
    from keys_values; head_scale: scores over sqrt(head_dim), MHA's, not sqrt(head_dim +
    rope_dim); all_rotary: the NoPE features of q and k rotated too (at head_dim's frequencies,
    as MHA's, for positions 0..T-1: a block from its start, as training reads it)."""

    name: ClassVar[str]  # its kind's
    head_scale: ClassVar[bool] = False
    all_rotary: ClassVar[bool] = False

    def __init__(self, config: Config, layer: int) -> None:
        super().__init__(config, layer)
        self.rope_theta = config.rope_theta

    def keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each head's K NoPE features and V, (B, T, 2 n_embd), and the rotary keys (B, T, keys *
        rope_dim), keys 1 or n_head."""
        raise NotImplementedError

    def forward(
        self, x: torch.Tensor, rope: Rope, mask: Mask, kv_cache: Cache | None
    ) -> torch.Tensor:
        if kv_cache is not None:
            raise UserError(
                f"{self.name} layers (scripts/mla_mqar_ablation.py) run full forwards only: "
                "decode without a cache (sample.py --kv_cache=False)"
            )
        B, T, C = x.shape
        H, hd, r = self.n_head, self.head_dim, self.rope_dim
        # the queries as MLA's: each head's NoPE features, then its rotary ones
        q = self.c_q(x) if self.q_lora_rank is None else self.q_b(self.q_norm(self.q_a(x)))
        q, q_rope = q.view(B, T, H, hd + r).transpose(1, 2).split((hd, r), dim=-1)
        kv, k_rope = self.keys_values(x)
        k, v = kv.view(B, T, H, 2, hd).permute(3, 0, 2, 1, 4).unbind(0)  # (B, H, T, hd) each
        k_rope = k_rope.view(B, T, -1, r).transpose(1, 2)  # (B, 1 or H, T, r)
        q_rope, k_rope = apply_rope(q_rope, *rope), apply_rope(k_rope, *rope)
        if self.all_rotary:
            tables = rope_tables(hd, T, self.rope_theta)
            cos, sin = (t.to(x.device).view(1, 1, T, hd // 2) for t in tables)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k = torch.cat((k, k_rope.expand(B, H, T, r)), dim=-1)
        q = torch.cat((q, q_rope), dim=-1)
        scale = hd**-0.5 if self.head_scale else (hd + r) ** -0.5
        dropout_p = self.dropout if self.training else 0.0
        y = sdpa(q, k, v, mask, dropout_p, cached=False, scale=scale).transpose(1, 2)
        if self.gate is not None:
            y = self.gate(x, y)
        return self.resid_dropout(self.c_proj(y.reshape(B, T, C)))


class RotaryKeyPerHead(ChangedLatentAttention, AblationKind):
    """P: MLA whose kv_a makes a rotary key for each head, not DeepSeek's one that the heads
    share (mla128-rope-per-head, mla128-holds-mha)."""

    letter = "P"
    name = "per-head rotary key MLA"

    def __init__(self, config: Config, layer: int) -> None:
        super().__init__(config, layer)
        # kv_a remade in its place: [latent | n_head rotary keys]
        width = self.kv_lora_rank + self.n_head * self.rope_dim
        self.kv_a = Linear(config.n_embd, width, bias=config.bias)

    def keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        latent, k_rope = self.kv_a(x).split(
            (self.kv_lora_rank, self.n_head * self.rope_dim), dim=-1
        )
        return self.kv_b(self.kv_norm(latent)), k_rope


class OneMap(ChangedLatentAttention, AblationKind):
    """O: K's NoPE features and V made from x by one matrix (kv_x), not through a latent; kv_a
    makes the one shared rotary key alone; no kv_b, no latent or its norm (mla128-one-map)."""

    letter = "O"
    name = "one-map MLA"
    matrices = ()  # no kv_b: smallgpt/quantize.py keeps none in the model's dtype

    def __init__(self, config: Config, layer: int) -> None:
        super().__init__(config, layer)
        # kv_a remade in its place, kv_x last: the names and order the patched class had
        self.kv_a = Linear(config.n_embd, self.rope_dim, bias=config.bias)
        del self.kv_b, self.kv_norm
        self.kv_x = Linear(config.n_embd, 2 * config.n_embd, bias=config.bias)

    def keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv_x(x), self.kv_a(x)


class OneMapHeadScale(OneMap):
    """H: one map (O), its scores over sqrt(head_dim) as MHA's (mla128-one-map-head-scale)."""

    letter = "H"
    name = "one-map MLA at MHA's scale"
    head_scale = True


class OneMapAllRotary(OneMap):
    """R: one map (O), its NoPE features rotated too (mla128-one-map-all-rotary)."""

    letter = "R"
    name = "all-rotary one-map MLA"
    all_rotary = True


class LatentMapsInAdamW(LatentAttention, AblationKind):
    """A: MLA as it is, its latent maps (kv_a, kv_b) left to AdamW under optimizer='muon', which
    takes the blocks' other matrices (mla128-latent-adamw)."""

    letter = "A"
    name = "AdamW-latent MLA"
    adamw_matrices = ("kv_a", "kv_b")
    static_step = "a training ablation's kind: its fixed-shape step is not checked"

    @classmethod
    def cache_spec(cls, config: Config) -> RowsSpec:
        return rows_spec(config)  # MLA's: its forward is LatentAttention's, its cache too


KINDS = (RotaryKeyPerHead, OneMap, OneMapHeadScale, OneMapAllRotary, LatentMapsInAdamW)


@contextmanager
def kinds_registered() -> Iterator[None]:
    """KINDS in model.LAYER_KINDS while the block runs (train.py's runs of them, and the checks
    that parse their configs), then taken out: a process that runs this script twice (a test)
    registers them afresh."""
    for kind in KINDS:
        register_kind(kind)
    try:
        yield
    finally:
        for kind in KINDS:
            if LAYER_KINDS.get(kind.letter) is kind:
                del LAYER_KINDS[kind.letter]


MLA = ["--kv_lora_rank=128"]  # DeepSeek-V2's proportions at n_embd=128: 4 head dims, rotary 16
SETTINGS = {
    "mha": [],
    "mla128": MLA,
    "mha-adamw": ["--optimizer=adamw"],
    "mla128-adamw": [*MLA, "--optimizer=adamw"],
    # the latent maps in AdamW (a kind: LatentMapsInAdamW)
    "mla128-latent-adamw": [*MLA, f"--layer_pattern={LatentMapsInAdamW.letter}"],
    "mla128-no-latent-norm": [*MLA, "--latent_norm=False"],
    "mla128-rope32": [*MLA, "--qk_rope_head_dim=32"],
    # a rotary key per head (a kind: RotaryKeyPerHead)
    "mla128-rope-per-head": [*MLA, f"--layer_pattern={RotaryKeyPerHead.letter}"],
    "mla128-muon-lr-half": [*MLA, "--muon_lr=0.01", "--learning_rate=1.5e-3", "--min_lr=1.5e-4"],
    "mla128-muon-lr-double": [*MLA, "--muon_lr=0.04", "--learning_rate=6e-3", "--min_lr=6e-4"],
    "mla128-lr-quarter": [*MLA, "--muon_lr=0.005", "--learning_rate=7.5e-4", "--min_lr=7.5e-5"],
    "mla128-lr-eighth": [*MLA, "--muon_lr=0.0025", "--learning_rate=3.75e-4", "--min_lr=3.75e-5"],
    # twice the iterations: slower to learn, or unable?
    "mla128-long": [*MLA, "--max_iters=3000", "--lr_decay_iters=3000"],
    # a rotary key per head too, as wide as MHA's, no latent norm: MHA is one of its functions
    # (zero NoPE queries, MHA's keys rotary, the values through the full-rank latent)
    "mla128-holds-mha": [
        *MLA,
        "--qk_rope_head_dim=32",
        "--latent_norm=False",
        f"--layer_pattern={RotaryKeyPerHead.letter}",
    ],
    # K's NoPE features and V straight from x (no latent), the shared rotary key kept; then with
    # MHA's softmax scale, or with the NoPE features rotated too (kinds: OneMap and its two)
    "mla128-one-map": [*MLA, f"--layer_pattern={OneMap.letter}"],
    "mla128-one-map-head-scale": [*MLA, f"--layer_pattern={OneMapHeadScale.letter}"],
    "mla128-one-map-all-rotary": [*MLA, f"--layer_pattern={OneMapAllRotary.letter}"],
    # MHA with half of each head's features NoPE: the first half rotated, at the frequencies of a
    # head_dim / 2 rotation (what the script's patch of apply_rope did, tested to be this key)
    "mha-half-rotary": ["--rope_fraction=0.5"],
}


def needs_kinds(setting: str) -> bool:
    """Whether setting's layers are of one of KINDS: its runs are this script's own process
    (--one=), which registers them before train.py."""
    return any(f"--layer_pattern={kind.letter}" in SETTINGS[setting] for kind in KINDS)


@dataclass(slots=True)
class AblationConfig:
    seeds: int = 3
    settings: list[str] | None = None  # of SETTINGS; None: all
    out: str = "out-mla-ablation"
    one: str = ""  # internal: run this setting in this process (its kind registered; ARGS: how)
    conversion: str = ""  # a trained rotary MHA run: its loss through each step of to_latent

    def __post_init__(self) -> None:
        problems = []
        if self.seeds < 1:
            problems.append(f"seeds={self.seeds} must be positive")
        if self.settings is not None:
            problems += setting_problems(self.settings)
        if self.one and not (self.one in SETTINGS and needs_kinds(self.one)):
            problems.append(f"one={self.one!r} is internal (a kind's setting's run): leave it out")
        if self.conversion and self.settings is not None:
            problems.append(
                f"conversion={self.conversion} measures a trained run, settings={self.settings} "
                "trains runs: give one of them"
            )
        if not self.out:
            problems.append("out='' names no folder")
        if problems:
            raise ValueError("; ".join(problems))


def setting_problems(settings: list[str]) -> list[str]:
    """What is wrong with --settings: none listed, a name of no setting, a setting twice."""
    if not settings:
        return ["settings=[] lists no setting: leave it out for all of them"]
    problems = []
    for name in [name for name in settings if name not in SETTINGS]:
        close = difflib.get_close_matches(name, SETTINGS, n=2)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        problems.append(f"settings: {name} is not a setting{hint}; they are {', '.join(SETTINGS)}")
    again = repeated(settings)
    if again is not None:
        problems.append(f"settings={settings} lists {again} twice: list it once")
    return problems


def run_args(setting: str, seed: int, folder: Path) -> list[str]:
    """train.py's arguments for setting's run of seed in folder."""
    return [
        str(ROOT / "config" / "compare" / "mqar.py"),
        "--n_embd=128",
        f"--seed={seed}",
        f"--out_dir={folder}",
        "--wandb_log=False",
        *SETTINGS[setting],
    ]


def check_runs(settings: list[str], out: Path) -> dict:
    """Before the first run: each setting's train.py config (as train.py reads it: a UserError
    naming the setting), and the dataset they train on, as train.py reads it (missing: load_meta's
    line; examples of another length than the config's block_size); that dataset's meta."""
    for setting in settings:
        folder = out / f"{setting}-s{FIRST_SEED}"
        try:
            train = parse_config(TrainConfig, run_args(setting, FIRST_SEED, folder))
        except UserError as e:
            raise UserError(f"settings: {setting}: {e}") from e
    # every setting trains on the config's dataset, at its block_size
    data = data_dir(train.dataset)
    batches = Batches(data, train.block_size, train.batch_size, train.seed, "cpu")
    recall.check_dataset(train.final_evals, batches.meta, train.block_size, str(data))
    return batches.meta


def finished(folder: Path) -> bool:
    """Whether the run in folder logged its recall record, its last."""
    log = folder / "log.jsonl"
    return log.is_file() and '"recall"' in log.read_text()


# what a finished run's dataset must share with today's to be reused: how it was prepared, its size
DATA_KEYS = ("settings", "vocab_size", "train_tokens", "val_tokens", "test_tokens")


def check_finished(settings: list[str], seeds: int, out: Path, meta: dict) -> None:
    """Before the first run: a run finished before is reused (not trained again) only where it was
    trained as this call would train it: its logged config (out_dir aside) and its dataset (the
    meta its checkpoint keeps, against today's); else a UserError naming the run and the
    differences."""
    for setting in settings:
        for seed in range(FIRST_SEED, FIRST_SEED + seeds):
            folder = out / f"{setting}-s{seed}"
            if not finished(folder):
                continue
            planned = parse_config(TrainConfig, run_args(setting, seed, folder))
            planned = json.loads(json.dumps(dataclasses.asdict(planned)))  # as a log holds it
            logged = read_run(folder)["config"]
            differ = [k for k in planned if k != "out_dir" and logged.get(k) != planned[k]]
            was = [f"{k}={logged.get(k)!r}" for k in differ]
            ckpt = folder / "ckpt.pt"
            trained_on = load_checkpoint(ckpt, "cpu", mmap=True).get("data_meta") or {}
            if any(trained_on.get(k) != meta.get(k) for k in DATA_KEYS):
                was.append(f"a dataset {planned['dataset']} prepared otherwise than today's")
            if was:
                raise UserError(
                    f"{folder} holds a finished run trained with {', '.join(was)}, not as this "
                    f"call trains {setting} at seed {seed}: delete it, or give --out=<another "
                    f"folder>"
                )


def run_one(args: list[str]) -> None:
    """train.py with args, in this process, the script's kinds registered (its args name one)."""
    with kinds_registered():
        sys.argv = ["train.py", *args]
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")


def summary(out: Path, settings: list[str], seeds: int) -> str:
    """The table: per setting, solved k/n at 0.9 (Clopper-Pearson 95%), the solved runs' mean
    accuracy, mean final test loss and each seed's accuracy."""
    from smallgpt import stats

    lines = [
        "| setting | solved (>= 0.9) | final test loss (mean ± 95%) | MQAR acc by seed |",
        "|---|---|---|---|",
    ]
    for setting in settings:
        accs, losses = [], []
        for seed in range(FIRST_SEED, FIRST_SEED + seeds):
            log = [json.loads(x) for x in (out / f"{setting}-s{seed}" / "log.jsonl").open()]
            final = next(r for r in log if r["event"] == "recall")
            accs.append(final["mqar"]["accuracy"])
            losses.append([r for r in log if r["event"] == "eval"][-1]["test_loss"])
        won = stats.solved(accs, 0.9)
        loss = stats.mean_interval(losses)
        by_seed = ", ".join(f"{a:.2f}" for a in accs)
        lines.append(f"| {setting} | {won.text()} | {loss.text()} | {by_seed} |")
    return "\n".join(lines)


@torch.no_grad()
def conversion_steps(run_dir: str) -> str:
    """The test loss and MQAR accuracy of a rotary MHA run (its own batches, its eval_iters), then
    of the same model with MHA2MLA's partial RoPE alone (rotation kept on every
    (head_dim / rope_dim)-th frequency pair, the others' removed), then of convert.to_latent at full
    rank (partial RoPE, and the heads' rotary keys pooled into the one MLA shares): which step the
    loss after conversion comes from."""
    from contextlib import nullcontext

    from smallgpt.checkpoint import load_run, parse_source
    from smallgpt.convert import rotary_features, to_latent
    from smallgpt.measure import evaluate

    what = f"conversion={run_dir}"
    try:
        run = load_run(parse_source("resume"), run_dir, tokenizer=False)
    except UserError as e:
        raise UserError(f"{what}: {e}") from e
    cfg, mha = run.config, run.model.eval()
    if mha.config.pos_encoding != "rope":
        raise UserError(
            f"{what} is a run with pos_encoding={mha.config.pos_encoding!r}: the conversion's "
            "steps start with partial RoPE, which needs rotary positions; give a rotary MHA run"
        )
    keys = ("dataset", "block_size", "batch_size", "seed", "eval_iters")
    if missing := [k for k in keys if k not in cfg]:
        raise UserError(
            f"{what}: its checkpoint records no {', '.join(missing)} (an older run's): "
            "give a run trained since"
        )
    rope_dim = mha.config.head_dim // 2  # MLA's default, as the comparison's mla<R> variants
    try:  # first: what MLA conversion refuses (a GQA or MLA run, ...), before any other step
        converted = to_latent(mha, mha.config.n_embd, rope_dim).eval()
    except UserError as e:
        raise UserError(f"{what}: {e}") from e
    batches = Batches(
        data_dir(cfg["dataset"]), cfg["block_size"], cfg["batch_size"], cfg["seed"], "cpu"
    )
    split = batches.held_out
    partial = load_run(parse_source("resume"), run_dir, tokenizer=False).model.eval()
    rope, _ = rotary_features(mha.config.head_dim, rope_dim)
    dropped = [i for i in range(mha.config.head_dim // 2) if i not in rope.tolist()]
    partial.rope_cos[:, dropped], partial.rope_sin[:, dropped] = 1.0, 0.0  # no rotation there
    lines = [f"| model ({run_dir}) | {split} loss | MQAR acc |", "|---|---|---|"]
    for name, model in (
        ("MHA as trained", mha),
        (f"partial RoPE ({rope_dim} of {mha.config.head_dim} features rotary)", partial),
        ("to_latent at full rank (partial RoPE + rotary keys pooled)", converted),
    ):
        loss = evaluate(model, batches, cfg["eval_iters"], nullcontext(), (split,))[split]
        acc = recall.mqar(model, batches, cfg["eval_iters"], split=split)["accuracy"]
        lines.append(f"| {name} | {loss:.4f} | {acc:.3f} |")
    return "\n".join(lines)


def main(cfg: AblationConfig) -> None:
    if cfg.conversion:
        with kinds_registered():  # the run may be one of a kind's setting: its checkpoint names it
            print(conversion_steps(cfg.conversion))
        return
    if cfg.one:
        if ARGS not in os.environ:
            raise UserError(f"one={cfg.one} is internal (a kind's setting's run): leave it out")
        run_one(json.loads(os.environ[ARGS]))
        return
    with kinds_registered():  # the checks parse each setting's config, its kind's letter too
        train_settings(cfg)


def train_settings(cfg: AblationConfig) -> None:
    """Every refusal before the first run, then each setting's runs not finished before, then the
    summary."""
    settings = cfg.settings or list(SETTINGS)
    out = Path(cfg.out).resolve()  # its runs start in the repository root; this may be elsewhere
    # every refusal before the first run: the folder, the runs' configs, the dataset
    check_claimable(out, KIND)
    meta = check_runs(settings, out)
    check_finished(settings, cfg.seeds, out, meta)
    claim_folder(out, KIND, {"command": sys.argv})
    for setting in settings:
        for seed in range(FIRST_SEED, FIRST_SEED + cfg.seeds):
            folder = out / f"{setting}-s{seed}"
            if finished(folder):
                continue  # finished before, as this call would train it (check_finished)
            args = run_args(setting, seed, folder)
            command = [sys.executable, str(ROOT / "train.py"), *args]
            if needs_kinds(setting):  # train.py in a process that registers its kind first
                command = [sys.executable, __file__, f"--one={setting}"]
            print(f"$ {setting} seed {seed}", flush=True)
            env = os.environ | {ARGS: json.dumps(args)}
            done = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
            if done.returncode:  # its own line said why (stderr is this script's)
                code = done.returncode
                sys.exit(code if code > 0 else 128 - code)  # a signal's: as a shell gives it
    print(summary(out, settings, cfg.seeds))


if __name__ == "__main__":
    run_cli(main, AblationConfig)
