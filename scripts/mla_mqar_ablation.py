"""Why MLA at full rank fails MQAR where MHA solves it: train.py on data/mqar at 2x128 (the README's
MQAR setting, config/compare/mqar.py) for each setting below over seeds, then one table of the runs
that solved it (MQAR accuracy >= 0.9 on the test split), with the Clopper-Pearson interval, and the
mean final test loss. docs/compare.md "MLA on MQAR, diagnosed" has the figures.

    python data/mqar/prepare.py
    python scripts/mla_mqar_ablation.py --seeds=3 [--settings=[mha,mla128]] [--out=DIR]
    # where the MHA -> MLA conversion's loss comes from, on a trained MHA run's test split
    python scripts/mla_mqar_ablation.py --conversion=out-mla-ablation/mha-s1337

Three settings change what no key of train.py changes, in this process only (patches, for this
diagnosis): `mla128-rope-per-head` gives each head its own rotary key (kv_a makes n_head of them
instead of DeepSeek's one shared), as does `mla128-holds-mha` (with a rotary key as wide as MHA's
and no latent norm: MHA is one of its functions), and `mla128-latent-adamw` leaves the latent maps
(kv_a, kv_b) to AdamW while Muon takes the other matrices.

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
from dataclasses import dataclass
from pathlib import Path

import torch

from configurator import parse_config, run_cli
from smallgpt import recall
from smallgpt.atomic import check_claimable, claim_folder
from smallgpt.checkpoint import load_checkpoint
from smallgpt.configs import TrainConfig, repeated
from smallgpt.data import Batches, data_dir
from smallgpt.errors import UserError
from smallgpt.runlog import read_run

ROOT = Path(__file__).resolve().parent.parent
ARGS = "SMALLGPT_ABLATION_ARGS"  # train.py's arguments for a patched setting's process (JSON)
KIND = "an MLA ablation"  # smallgpt/atomic.py's kind: ablation.json marks the out folder
FIRST_SEED = 1337  # the runs' seeds: FIRST_SEED, FIRST_SEED + 1, ...

MLA = ["--kv_lora_rank=128"]  # DeepSeek-V2's proportions at n_embd=128: 4 head dims, rotary 16
SETTINGS = {
    "mha": [],
    "mla128": MLA,
    "mha-adamw": ["--optimizer=adamw"],
    "mla128-adamw": [*MLA, "--optimizer=adamw"],
    "mla128-latent-adamw": MLA,  # patched: the latent maps in AdamW
    "mla128-no-latent-norm": [*MLA, "--latent_norm=False"],
    "mla128-rope32": [*MLA, "--qk_rope_head_dim=32"],
    "mla128-rope-per-head": MLA,  # patched: a rotary key per head
    "mla128-muon-lr-half": [*MLA, "--muon_lr=0.01", "--learning_rate=1.5e-3", "--min_lr=1.5e-4"],
    "mla128-muon-lr-double": [*MLA, "--muon_lr=0.04", "--learning_rate=6e-3", "--min_lr=6e-4"],
    "mla128-lr-quarter": [*MLA, "--muon_lr=0.005", "--learning_rate=7.5e-4", "--min_lr=7.5e-5"],
    "mla128-lr-eighth": [*MLA, "--muon_lr=0.0025", "--learning_rate=3.75e-4", "--min_lr=3.75e-5"],
    # twice the iterations: slower to learn, or unable?
    "mla128-long": [*MLA, "--max_iters=3000", "--lr_decay_iters=3000"],
    # patched too: a rotary key per head, as wide as MHA's, no latent norm: MHA is one of its
    # functions (zero NoPE queries, MHA's keys rotary, the values through the full-rank latent)
    "mla128-holds-mha": [*MLA, "--qk_rope_head_dim=32", "--latent_norm=False"],
    # patched: K's NoPE features and V straight from x (no latent), the shared rotary key kept;
    # then with MHA's softmax scale, or with the NoPE features rotated too
    "mla128-one-map": MLA,
    "mla128-one-map-head-scale": MLA,
    "mla128-one-map-all-rotary": MLA,
    # patched: MHA with half of each head's features NoPE
    "mha-half-rotary": [],
}


@dataclass(slots=True)
class AblationConfig:
    seeds: int = 3
    settings: list[str] | None = None  # of SETTINGS; None: all
    out: str = "out-mla-ablation"
    one: str = ""  # internal: run this setting in this process (its patch applied; ARGS: how)
    conversion: str = ""  # a trained rotary MHA run: its loss through each step of to_latent

    def __post_init__(self) -> None:
        problems = []
        if self.seeds < 1:
            problems.append(f"seeds={self.seeds} must be positive")
        if self.settings is not None:
            problems += setting_problems(self.settings)
        if self.one and self.one not in PATCHED:
            problems.append(f"one={self.one!r} is internal (a patched setting's run): leave it out")
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


def patched_latent_attention(
    rope_per_head: bool, one_map: bool, head_scale: bool = False, all_rotary: bool = False
) -> None:
    """LatentAttention changed for a training ablation (full forwards only: the absorbed decoding
    step is left as it is): rope_per_head, a rotary key per head (kv_a makes n_head of them, not
    DeepSeek's one shared); one_map, K's NoPE features and V made from x by one matrix (kv_x), not
    through the latent (kv_a then makes the rotary keys alone, and there is no kv_b or latent);
    head_scale, scores divided by sqrt(head_dim), MHA's, not sqrt(head_dim + rope_dim);
    all_rotary, the NoPE features of q and k rotated too (at head_dim's frequencies, as MHA's)."""
    import attention
    from attention import Linear, apply_rope, rope_tables

    original_init = attention.LatentAttention.__init__

    def init(self, layer, n_embd, n_head, kv_lora_rank, rope_dim, *rest):  # noqa: ANN001, ANN202
        original_init(self, layer, n_embd, n_head, kv_lora_rank, rope_dim, *rest)
        bias = self.kv_a.bias is not None
        keys = n_head * rope_dim if rope_per_head else rope_dim
        self.kv_a = Linear(n_embd, keys if one_map else kv_lora_rank + keys, bias=bias)
        if one_map:
            del self.kv_b
            self.kv_x = Linear(n_embd, 2 * n_embd, bias=bias)

    def forward(self, x, rope, mask, kv_cache):  # noqa: ANN001, ANN202
        assert kv_cache is None, "a training ablation"
        B, T, C = x.shape
        H, hd, r = self.n_head, self.head_dim, self.rope_dim
        q = self.c_q(x).view(B, T, H, hd + r).transpose(1, 2)
        q, q_rope = q.split((hd, r), dim=-1)
        if one_map:
            kv, k_rope = self.kv_x(x), self.kv_a(x)
        else:
            latent, k_rope = self.kv_a(x).split(
                (self.kv_lora_rank, self.kv_a.out_features - self.kv_lora_rank), dim=-1
            )
            kv = self.kv_b(self.kv_norm(latent))
        k_rope = k_rope.view(B, T, -1, r).transpose(1, 2)  # (B, H or 1, T, r)
        q_rope, k_rope = apply_rope(q_rope, *rope), apply_rope(k_rope, *rope)
        k, v = kv.view(B, T, H, 2, hd).permute(3, 0, 2, 1, 4).unbind(0)
        if all_rotary:
            cos, sin = (t.to(x.device).view(1, 1, T, hd // 2) for t in rope_tables(hd, T, 1e4))
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k = torch.cat((k, k_rope.expand(B, H, T, r)), dim=-1)
        q = torch.cat((q, q_rope), dim=-1)
        scale = hd**-0.5 if head_scale else (hd + r) ** -0.5
        y = attention.attention(q, k, v, mask, 0.0, cached=False, scale=scale)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, C)))

    attention.LatentAttention.__init__ = init
    attention.LatentAttention.forward = forward


def half_rotary_mha() -> None:
    """MHA (CausalSelfAttention) with half of each head's q and k features rotary (at the
    frequencies of a head_dim / 2 rotation), the other half NoPE: MLA's decoupled features without
    the latent, in MHA."""
    import attention

    def apply_rope(x, cos, sin):  # noqa: ANN001, ANN202
        T, r = x.shape[-2], x.shape[-1] // 2
        half_cos, half_sin = (
            t.to(x.device).view(1, 1, T, r // 2) for t in attention.rope_tables(r, T, 1e4)
        )
        rotated = original(x[..., :r], half_cos, half_sin)
        return torch.cat((rotated, x[..., r:]), dim=-1)

    original = attention.apply_rope
    attention.apply_rope = apply_rope


def latent_maps_in_adamw() -> None:
    """Muon for the blocks' matrices but the latent maps (kv_a, kv_b), which AdamW takes with the
    embeddings, norms and biases."""
    from smallgpt import optim

    original = optim.make_optimizer

    def make_optimizer(model, kind, *args, **kwargs):  # noqa: ANN001, ANN202
        named = model.named_parameters

        def without_latent_maps(*a, **k):  # noqa: ANN002, ANN003, ANN202
            for name, p in named(*a, **k):
                latent = ".attn.kv_a." in name or ".attn.kv_b." in name
                # AdamW's: a name outside the blocks, as optim.make_optimizer sorts them
                yield (f"latent.{name}" if latent else name), p

        model.named_parameters = without_latent_maps
        try:
            return original(model, kind, *args, **kwargs)
        finally:
            del model.named_parameters

    optim.make_optimizer = make_optimizer


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


def run_one(setting: str, args: list[str]) -> None:
    """train.py with args, in this process, after setting's patch."""
    PATCHED[setting]()
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


PATCHED = {
    "mla128-latent-adamw": latent_maps_in_adamw,
    "mla128-rope-per-head": lambda: patched_latent_attention(rope_per_head=True, one_map=False),
    "mla128-holds-mha": lambda: patched_latent_attention(rope_per_head=True, one_map=False),
    "mla128-one-map": lambda: patched_latent_attention(rope_per_head=False, one_map=True),
    "mla128-one-map-head-scale": lambda: patched_latent_attention(False, True, head_scale=True),
    "mla128-one-map-all-rotary": lambda: patched_latent_attention(False, True, all_rotary=True),
    "mha-half-rotary": half_rotary_mha,
}


def main(cfg: AblationConfig) -> None:
    if cfg.conversion:
        print(conversion_steps(cfg.conversion))
        return
    if cfg.one:
        if ARGS not in os.environ:
            raise UserError(f"one={cfg.one} is internal (a patched setting's run): leave it out")
        run_one(cfg.one, json.loads(os.environ[ARGS]))
        return
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
            if setting in PATCHED:
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
