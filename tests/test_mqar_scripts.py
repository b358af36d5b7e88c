"""The scripts the docs point users to on MQAR, scripts/zoology_mqar.py and
scripts/mla_mqar_ablation.py: the figure they draw, the folders they take (only their own), the
datasets they reuse (only those of their settings), and every mistake one line before any work,
with nothing written (issue 66). The ablation's settings that no key of train.py makes are kinds of
layer the script registers, not patches of other modules: each builds the layers it names and
trains a step, and mha-half-rotary is rope_fraction=0.5, the patch it was."""

import ast
import csv
import json
import runpy
import subprocess
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest
import torch

import attention
from configurator import parse_config
from conftest import ROOT, Result, cli, run
from model import GPT, LAYER_KINDS, GPTConfig, register_kind
from smallgpt.checkpoint import save_checkpoint
from smallgpt.configs import TrainConfig
from smallgpt.data import load_meta
from smallgpt.errors import UserError

ZOOLOGY = "scripts/zoology_mqar.py"
ABLATION = "scripts/mla_mqar_ablation.py"
# a small figure: 2 pairs in examples of 12 tokens, 8 keys, 8 values, 300 training examples
SMALL = ["--pairs=[2]", "--widths=[16]", "--seq_len=12", "--key_vocab=8", "--value_vocab=8"]
SMALL += ["--train_examples=300", "--max_iters=4"]


def refused(r: Result, *says: str) -> None:
    """r is one `error:` line and exit 2, holding each of says."""
    one_line = r.stderr.startswith("error: ") and r.stderr.count("\n") == 1
    assert r.returncode == 2 and one_line, r.stderr
    for text in says:
        assert text in r.stderr, r.stderr


@pytest.fixture
def no_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ablation script's train.py runs (subprocesses) fail the test: a mistake is said before
    the first."""

    def started(command: list[str], **kwargs: object) -> None:
        raise AssertionError(f"a run started: {command}")

    monkeypatch.setattr(subprocess, "run", started)


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data folder holding a small `mqar` (prepare.py's defaults: examples of 32 tokens, as the
    ablation's config trains on), 300 training examples."""
    root = tmp_path_factory.mktemp("data")
    counts = ["--train_examples=300", "--val_examples=50", "--test_examples=50"]
    run(["data/mqar/prepare.py", f"--out_dir={root / 'mqar'}", *counts])
    return root


def test_the_zoology_script_draws_accuracy_against_width_per_pair_count(tmp_path: Path) -> None:
    """scripts/zoology_mqar.py at 2 and 3 pairs, widths 16 and 32: a Zoology-layout dataset and a
    comparison per pair count, and a table whose cells are each comparison's MQAR accuracy. Run
    from a folder of its own with relative paths: what it writes and reads is there, not in the
    repository (its steps once ran from the repository's root and wrote there). Called again with
    other data settings or another budget, it refuses before any work."""
    flags = [
        ZOOLOGY,
        "--pairs=[2,3]",
        "--widths=[16,32]",
        "--n_layer=1",
        "--variants=[mha]",
        "--seq_len=12",
        "--key_vocab=8",
        "--value_vocab=8",
        "--train_examples=300",
        "--max_iters=4",
        "--decode_context=16",
        "--out=zoo",
        "--data=data",
    ]
    r = cli(flags, env={"WANDB_MODE": "disabled"}, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "zoo"
    assert load_meta(tmp_path / "data" / "mqar-zoology-p3")["example_tokens"] == 12
    md = (out / "zoology.md").read_text()
    assert "| pairs | variant | width 16 | width 32 |" in md
    for pairs in (2, 3):
        rows = {r["size"]: r for r in csv.DictReader(open(out / f"p{pairs}" / "report.csv"))}
        cells = [f"{float(rows[f'1x{w}']['mqar_acc']):.3f} (0/1 solved)" for w in (16, 32)]
        assert f"| {pairs} | mha | {cells[0]} | {cells[1]} |" in md
    assert (out / "zoology.png").read_bytes()[:4] == b"\x89PNG"
    assert not (ROOT / "zoo").exists() and not (ROOT / "data" / "mqar-zoology-p2").exists()
    # the out folder is marked as the script's, with the settings of its runs
    marker = json.loads((out / "zoology.json").read_text())
    assert marker["kind"] == "a Zoology figure" and marker["settings"]["max_iters"] == 4
    # the datasets are reused only with the settings they record
    r = cli([*flags, "--out=zoo2", "--key_vocab=16"], cwd=tmp_path)
    p2 = Path("data") / "mqar-zoology-p2"
    refused(r, f"{p2} was prepared with key_vocab=8, not this call's key_vocab=16", "--data=")
    assert not (tmp_path / "zoo2").exists()
    # and the out folder's runs are resumed only at their budget
    r = cli([*flags, "--max_iters=8"], cwd=tmp_path)
    refused(r, "zoo holds comparisons made with max_iters=4, not this call's max_iters=8")


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--variants=[mha,bogus]"], "error: variants: bogus is not mha"),
        (["--lrs=[-1]"], "lrs=[-1.0]: learning rates must be positive"),
        (["--seeds=0"], "seeds=0 must be positive"),
        (["--n_layer=0"], "n_layer=0 must be positive"),
        (["--max_iters=0"], "max_iters=0 must be positive"),
        (["--widths=[16,16]"], "widths=[16, 16] lists 16 twice"),
        (["--lrs=[1e-3,0.001]"], "lrs=[0.001, 0.001] lists 0.001 twice"),
        # the prepare script's checks, in this script's keys
        (["--pairs=[4]"], "seq_len=12 < 4*pairs = 16 for pairs=4"),
        (["--key_vocab=1"], "key_vocab=1 < pairs=2"),
        # what compare.py and train.py would refuse of a width or a variant
        (["--widths=[30]"], "width 30 (n_layer=2; config/compare/mqar.py's n_head=4"),
        (["--variants=[gqa3]"], "variants: gqa3 at width 16"),
        (["--variants=[gqa4]"], "gqa4 is mha at n_head=4: name it mha"),
        (["--variants=[mha-sl16]"], "window=16 is not below block_size=11"),
    ],
)
def test_the_zoology_script_says_each_mistake_in_one_line_before_any_work(
    tmp_path: Path, flags: list[str], says: str
) -> None:
    """A mistake in any key, or one that compare.py, train.py or the prepare script would find in
    what the script passes them, is one line naming the script's keys, before any dataset is
    prepared or the out folder made."""
    where = [f"--out={tmp_path / 'zoo'}", f"--data={tmp_path / 'data'}"]
    r = cli([ZOOLOGY, *SMALL, *where, *flags])
    refused(r, says)
    assert list(tmp_path.iterdir()) == []


def test_the_zoology_script_takes_no_folder_it_did_not_make(tmp_path: Path) -> None:
    """--out holding a user's zoology.md and zoology.png, or a file: refused in one line before any
    dataset is prepared, and the user's files are as they were."""
    user = tmp_path / "userout"
    user.mkdir()
    (user / "zoology.md").write_text("my table")
    (user / "zoology.png").write_bytes(b"my figure")
    data = f"--data={tmp_path / 'data'}"
    r = cli([ZOOLOGY, *SMALL, f"--out={user}", data])
    refused(r, f"{user} holds files this tool did not write (zoology.md, zoology.png)")
    assert (user / "zoology.md").read_text() == "my table"
    assert (user / "zoology.png").read_bytes() == b"my figure"
    assert sorted(p.name for p in user.iterdir()) == ["zoology.md", "zoology.png"]
    r = cli([ZOOLOGY, *SMALL, f"--out={user / 'zoology.md'}", data])
    refused(r, "is a file, not a folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["userout"]


def test_the_zoology_script_reuses_a_dataset_only_when_it_records_this_calls_settings(
    tmp_path: Path,
) -> None:
    """A dataset in the script's place prepared with other settings (of its keys, or of the
    prepare script's alone), or recording none, is refused in one line naming the differences, and
    nothing is written."""
    data = tmp_path / "data" / "mqar-zoology-p2"
    made = ["--layout=zoology", "--num_pairs=2", "--seq_len=12", "--key_vocab=8"]
    made += ["--value_vocab=8", "--train_examples=300", "--val_examples=200"]
    run(["data/mqar/prepare.py", f"--out_dir={data}", *made])
    meta = (data / "meta.json").read_text()
    call = [ZOOLOGY, *SMALL, f"--out={tmp_path / 'zoo'}", f"--data={tmp_path / 'data'}"]
    r = cli([*call, "--key_vocab=16", "--train_examples=1000"])
    was = "key_vocab=8, train_examples=300, val_examples=200"
    now = "key_vocab=16, train_examples=1000, val_examples=1000"
    refused(r, f"{data} was prepared with {was}, not this call's {now}: delete it, or give --data=")
    # one made before datasets recorded their settings
    (data / "meta.json").write_text(
        json.dumps({k: v for k, v in json.loads(meta).items() if k != "settings"})
    )
    r = cli(call)
    refused(r, f"{data} records no settings")
    assert not (tmp_path / "zoo").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--settings=[bogus]"], "settings: bogus is not a setting; they are mha, mla128, "),
        (["--settings=[mla12]"], "(did you mean mla128 or mla128-long?)"),
        (["--settings=[mha,mha]"], "settings=['mha', 'mha'] lists mha twice"),
        (["--settings=[]"], "settings=[] lists no setting"),
        (["--seeds=0"], "seeds=0 must be positive"),
        (["--one=mha"], "one='mha' is internal"),
        (["--conversion=run", "--settings=[mha]"], "give one of them"),
    ],
)
def test_the_ablation_script_says_each_mistake_in_one_line_before_any_work(
    tmp_path: Path, flags: list[str], says: str, no_runs: None
) -> None:
    r = cli([ABLATION, f"--out={tmp_path / 'abl'}", *flags])
    refused(r, says)
    assert list(tmp_path.iterdir()) == []


def test_the_ablation_script_needs_its_dataset_before_the_first_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_runs: None
) -> None:
    """data/mqar missing: the standard line, before any run starts or the out folder is made."""
    monkeypatch.setattr("smallgpt.data.DATA_ROOT", tmp_path / "data")
    r = cli([ABLATION, "--settings=[mha]", "--seeds=1", f"--out={tmp_path / 'abl'}"])
    refused(r, f"no dataset at {tmp_path / 'data' / 'mqar'} (missing meta.json)")
    assert list(tmp_path.iterdir()) == []


def test_a_failing_ablation_run_ends_the_script_with_its_status(
    tmp_path: Path, data_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A train.py run that fails (its own line said why) ends the script with its exit status and
    no traceback; the out folder is marked as the script's, and a user's folder is not taken."""
    monkeypatch.setattr("smallgpt.data.DATA_ROOT", data_root)
    commands = []

    def failing(command: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        commands.append(command)
        return subprocess.CompletedProcess(command, 3)

    monkeypatch.setattr(subprocess, "run", failing)
    out = tmp_path / "abl"
    r = cli([ABLATION, "--settings=[mha,mla128]", "--seeds=2", f"--out={out}"])
    assert r.returncode == 3 and "Traceback" not in r.stderr and r.stderr == "", r.stderr
    assert len(commands) == 1 and commands[0][1] == str(ROOT / "train.py")
    assert json.loads((out / "ablation.json").read_text())["kind"] == "an MLA ablation"
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.md").write_text("mine")
    r = cli([ABLATION, "--settings=[mha]", f"--out={user}"])
    refused(r, f"{user} holds files this tool did not write (notes.md)")
    assert len(commands) == 1 and [p.name for p in user.iterdir()] == ["notes.md"]


@pytest.mark.parametrize(
    "model, says",
    [
        (dict(pos_encoding="learned"), "is a run with pos_encoding='learned'"),
        (dict(pos_encoding="rope", kv_lora_rank=16), "and this one is MLA"),
    ],
)
def test_the_ablation_script_measures_the_conversion_of_a_rotary_mha_run_only(
    tmp_path: Path, data_root: Path, model: dict, says: str
) -> None:
    """--conversion of a run with learned positions, or of an MLA run: one line naming the key,
    before any step is measured."""
    config = GPTConfig(n_layer=1, n_head=4, n_embd=32, block_size=31, vocab_size=128, **model)
    data = data_root / "mqar"
    (tmp_path / "run").mkdir()
    keys = dict(dataset=str(data), block_size=31, batch_size=4, seed=1337, eval_iters=1)
    meta = load_meta(data)
    save_checkpoint(
        tmp_path / "run" / "ckpt.pt", GPT(config), iter_num=0, data_meta=meta, config=keys
    )
    r = cli([ABLATION, f"--conversion={tmp_path / 'run'}"])
    refused(r, f"conversion={tmp_path / 'run'}", says)


def test_a_finished_ablation_run_is_reused_only_as_this_call_would_train_it(
    tmp_path: Path, data_root: Path, monkeypatch: pytest.MonkeyPatch, no_runs: None
) -> None:
    """A run that logged its recall record is not trained again where its logged config and its
    dataset are this call's; trained otherwise (another budget in the log, or a dataset prepared
    again since), it is one line before any run starts, naming the difference."""
    import dataclasses

    from configurator import parse_config
    from train import TrainConfig

    monkeypatch.setattr("smallgpt.data.DATA_ROOT", data_root)
    out = tmp_path / "abl"
    folder = out / "mha-s1337"
    folder.mkdir(parents=True)
    (out / "ablation.json").write_text('{"kind": "an MLA ablation"}')
    args = [str(ROOT / "config/compare/mqar.py"), "--n_embd=128", "--seed=1337"]
    args += [f"--out_dir={folder}", "--wandb_log=False"]
    config = dataclasses.asdict(parse_config(TrainConfig, args))
    meta = load_meta(data_root / "mqar")

    def finished_run(config: dict, meta: dict) -> None:
        records = [
            {"event": "config", "config": config, "start_iter": 0, "model_config": {}},
            {"event": "eval", "iter": 1500, "val_loss": 0.5, "test_loss": 0.6, "elapsed_s": 1},
            {"event": "recall", "iter": 1500, "mqar": {"accuracy": 0.95, "correct": 95, "n": 100}},
        ]
        (folder / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=8, vocab_size=128))
        save_checkpoint(folder / "ckpt.pt", model, iter_num=1500, data_meta=meta)

    finished_run(config, meta)
    command = [ABLATION, "--settings=[mha]", "--seeds=1", f"--out={out}"]
    r = cli(command)
    assert r.returncode == 0 and "| mha | 1/1" in r.stdout, r.stderr
    finished_run(config | {"max_iters": 3000}, meta)
    refused(cli(command), f"{folder} holds a finished run trained with max_iters=3000, not as")
    finished_run(config, meta | {"settings": meta["settings"] | {"key_vocab": 32}})
    refused(cli(command), "a dataset mqar prepared otherwise than today's")


# ---- the ablation's kinds of layer: its settings that no key of train.py makes ----

# each setting that was a patch of another module, and the letter of the kind it now names
KIND_SETTINGS = {
    "mla128-rope-per-head": "P",
    "mla128-holds-mha": "P",
    "mla128-one-map": "O",
    "mla128-one-map-head-scale": "H",
    "mla128-one-map-all-rotary": "R",
    "mla128-latent-adamw": "A",
}
MQAR_VOCAB = 128  # data/mqar's vocabulary at prepare.py's defaults: 64 keys, 64 values


@pytest.fixture(scope="module")
def ablation() -> dict[str, Any]:
    """The ablation script's names (run, not as __main__: its kinds defined, none registered)."""
    return runpy.run_path(str(ROOT / ABLATION))


@pytest.fixture
def kinds(ablation: dict[str, Any]) -> Generator[None, None, None]:
    """The script's kinds in model.LAYER_KINDS for the test, then taken out."""
    for kind in ablation["KINDS"]:
        register_kind(kind)
    yield
    for kind in ablation["KINDS"]:
        del LAYER_KINDS[kind.letter]


def setting_model(ablation: dict[str, Any], setting: str, folder: Path) -> tuple[GPT, TrainConfig]:
    """The model of setting's run as run_one's train.py builds it (its config from the setting's
    train.py arguments, its vocabulary MQAR's), and that config."""
    cfg = parse_config(TrainConfig, ablation["run_args"](setting, 1337, folder))
    return GPT(cfg.model_config(MQAR_VOCAB)), cfg


def loss_and_grads(model: GPT) -> float:
    """A training forward and backward on one random batch of 2 examples: every parameter gets a
    gradient (none is left unused); the loss."""
    idx = torch.randint(0, MQAR_VOCAB, (2, 31))
    _, loss = model(idx, torch.randint(0, MQAR_VOCAB, (2, 31)))
    loss.backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []
    return loss.item()


def test_each_kind_setting_builds_the_layers_it_names_and_trains_a_step(
    ablation: dict[str, Any], kinds: None, tmp_path: Path
) -> None:
    """Each formerly patched MLA setting, parsed as its run parses it: every layer of its kind,
    kv_a as wide as its rotary keys (a key per head: n_head * qk_rope_head_dim), kv_x without kv_b
    or a latent with one map; a forward and backward run with a gradient for every parameter."""
    for setting, letter in KIND_SETTINGS.items():
        model, _ = setting_model(ablation, setting, tmp_path / setting)
        c = model.config
        H, r, R, C = c.n_head, c.qk_rope_head_dim, c.kv_lora_rank, c.n_embd
        assert c.layer_letters == letter * c.n_layer, setting
        attn = model.transformer.h[0].attn
        assert type(attn) is LAYER_KINDS[letter] and attn.rope_dim == r
        names = {name.split(".")[0] for name, _ in attn.named_parameters()}
        if letter == "P":  # [latent | a rotary key per head], K and V from the latent
            assert attn.kv_a.out_features == R + H * r and attn.kv_b.in_features == R
            assert names == {"c_q", "kv_a", "kv_b", "c_proj"} | (
                {"kv_norm"} if c.latent_norm else set()
            )
        elif letter == "A":  # MLA's own layers
            assert attn.kv_a.out_features == R + r and "kv_b" in names
        else:  # one map: the rotary key alone from kv_a, K's NoPE features and V from kv_x
            assert attn.kv_a.out_features == r
            assert attn.kv_x.weight.shape == (2 * C, C)
            assert names == {"c_q", "kv_a", "kv_x", "c_proj"}
        assert loss_and_grads(model) > 0
    # holds-mha: a rotary key per head as wide as MHA's, and no latent norm
    model, _ = setting_model(ablation, "mla128-holds-mha", tmp_path / "holds")
    assert model.transformer.h[0].attn.kv_a.out_features == 128 + 4 * 32


def test_the_latent_adamw_kind_leaves_its_latent_maps_to_adamw(
    ablation: dict[str, Any], kinds: None, tmp_path: Path
) -> None:
    """mla128-latent-adamw under its run's optimizer (Muon): AdamW takes kv_a and kv_b, Muon the
    blocks' other matrices, as mla128's Muon takes them all."""
    from smallgpt.optim import make_optimizer

    def muon_names(setting: str) -> list[str]:
        model, cfg = setting_model(ablation, setting, tmp_path / setting)
        betas = (cfg.beta1, cfg.beta2)
        opt = make_optimizer(model, cfg.optimizer, 0.1, 1e-3, betas, "cpu", cfg.muon_lr)
        muon = {id(p) for group in opt.optimizers[0].param_groups for p in group["params"]}
        return [name for name, p in model.named_parameters() if id(p) in muon]

    latent = [f"transformer.h.{i}.attn.{m}.weight" for i in (0, 1) for m in ("kv_a", "kv_b")]
    mla = muon_names("mla128")
    assert set(latent) <= set(mla)
    assert muon_names("mla128-latent-adamw") == [n for n in mla if n not in latent]


def test_the_one_map_kinds_differ_only_by_their_scale_and_rotation(
    ablation: dict[str, Any], kinds: None, tmp_path: Path
) -> None:
    """The three one-map settings' models hold the same parameters; on the same weights MHA's
    softmax scale (H) and the NoPE features rotated (R) each give other logits than O's."""
    models = [
        setting_model(ablation, s, tmp_path / s)[0].eval() for s in KIND_SETTINGS if "one-map" in s
    ]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    idx = torch.randint(0, MQAR_VOCAB, (2, 31))
    with torch.no_grad():
        one_map, head_scale, all_rotary = (m(idx, idx)[0] for m in models)
    assert not torch.allclose(one_map, head_scale, atol=1e-4)
    assert not torch.allclose(one_map, all_rotary, atol=1e-4)


def test_the_kinds_refuse_a_cache_and_export_in_one_line(
    ablation: dict[str, Any], kinds: None
) -> None:
    """What each kind declares: an unused upper-case letter, attends, a reason the fixed-shape step
    cannot run it, no transformers layer type (export refuses it); a full-forward kind's layers
    refuse a cache in one line (a training ablation: train.py builds none)."""
    from smallgpt.hf import target_class

    for kind in ablation["KINDS"]:
        assert kind.letter.isupper() and kind.letter not in "LSD" and kind.attends
        assert kind.static_step and kind.hf_layer_type is None
    config = GPTConfig(
        n_layer=1,
        n_head=4,
        n_embd=32,
        block_size=16,
        vocab_size=61,
        pos_encoding="rope",
        kv_lora_rank=16,
        layer_pattern="O",
    )
    with pytest.raises(UserError, match="no transformers class holds one-map MLA layers"):
        target_class(config)
    model = GPT(config)
    with pytest.raises(UserError, match=r"one-map MLA layers .* run full forwards only") as e:
        model(torch.randint(0, 61, (1, 4)), kv_cache=model.make_kv_cache(1))
    assert "\n" not in str(e.value)


def test_a_kind_setting_needs_its_kind_registered(ablation: dict[str, Any], tmp_path: Path) -> None:
    """Outside a process that registers the script's kinds, a kind's setting (as its checkpoint's
    layer_pattern) is refused in one line naming the letter."""
    args = ablation["run_args"]("mla128-one-map", 1337, tmp_path)
    with pytest.raises(UserError, match="layer_pattern='O' must be letters L"):
        parse_config(TrainConfig, args)


def test_a_kind_setting_runs_in_the_process_that_registers_its_kind(
    tmp_path: Path, data_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kind's setting: its config checked before the first run (its kind registered for the
    check), its run the script itself with --one= and train.py's arguments naming the letter; the
    kinds are out of model.LAYER_KINDS once the script returns."""
    monkeypatch.setattr("smallgpt.data.DATA_ROOT", data_root)
    kinds = set(LAYER_KINDS)
    calls = []

    def failing(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        calls.append((command, json.loads(kwargs["env"]["SMALLGPT_ABLATION_ARGS"])))
        return subprocess.CompletedProcess(command, 3)

    monkeypatch.setattr(subprocess, "run", failing)
    r = cli([ABLATION, "--settings=[mla128-one-map]", "--seeds=1", f"--out={tmp_path / 'abl'}"])
    assert r.returncode == 3 and r.stderr == "", r.stderr
    [(command, args)] = calls
    assert command[1:] == [str(ROOT / ABLATION), "--one=mla128-one-map"]
    assert args[-2:] == ["--kv_lora_rank=128", "--layer_pattern=O"]
    assert set(LAYER_KINDS) == kinds


def half_rotary_patch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The ablation script's patch of attention.apply_rope for mha-half-rotary, as it was: the first
    half of each head's features rotated at the frequencies of a head_dim / 2 rotation, at positions
    0..T-1 (the tables it was given unused), the other half as it is."""
    T, r = x.shape[-2], x.shape[-1] // 2
    tables = attention.rope_tables(r, T, 1e4)
    half_cos, half_sin = (t.to(x.device).view(1, 1, T, r // 2) for t in tables)
    rotated = APPLY_ROPE(x[..., :r], half_cos, half_sin)
    return torch.cat((rotated, x[..., r:]), dim=-1)


APPLY_ROPE = attention.apply_rope  # the function the patch wrapped


def test_mha_half_rotary_is_rope_fraction_one_half(
    ablation: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The setting's model (rope_fraction=0.5: tables for int(head_dim * 0.5) features at
    rope_theta 10000) gives the logits and gradients, fp32 and under bf16 autocast, that the
    patched MHA (rope_fraction=1, apply_rope patched) gives on the same weights."""
    assert ablation["SETTINGS"]["mha-half-rotary"] == ["--rope_fraction=0.5"]
    half, _ = setting_model(ablation, "mha-half-rotary", tmp_path / "half")
    patched, _ = setting_model(ablation, "mha", tmp_path / "mha")
    assert (half.config.rope_dim, patched.config.rope_dim) == (16, 32)
    patched.load_state_dict(half.state_dict())
    idx, targets = (torch.randint(0, MQAR_VOCAB, (4, 31)) for _ in range(2))

    def outputs(model: GPT) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """Its fp32 logits, bf16 autocast logits and gradients on the batch."""
        logits, loss = model(idx, targets)
        loss.backward()
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
            bf16 = model(idx, targets)[0]
        return logits, bf16, [p.grad for p in model.parameters()]

    logits, bf16, grads = outputs(half)
    with torch.no_grad():  # the patch changes MHA: without it, other logits
        assert not torch.allclose(patched(idx, targets)[0], logits, atol=1e-4)
    monkeypatch.setattr(attention, "apply_rope", half_rotary_patch)
    patched_logits, patched_bf16, patched_grads = outputs(patched)
    assert torch.equal(logits, patched_logits) and torch.equal(bf16, patched_bf16)
    assert all(torch.equal(a, b) for a, b in zip(grads, patched_grads, strict=True))


def module_patches(source: str) -> list[str]:
    """The targets in source of an assignment, deletion or setattr that changes an attribute of a
    project module (attention, model, smallgpt.optim, ...) or of a name imported from one."""
    tree = ast.parse(source)
    project = {p.stem for p in ROOT.glob("*.py")} | {"smallgpt"}
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [(a.name, a.asname or a.name.split(".")[0]) for a in node.names]
            imported |= {bound for name, bound in names if name.split(".")[0] in project}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in project:
            imported |= {a.asname or a.name for a in node.names}

    def root(target: ast.expr) -> str | None:
        while isinstance(target, ast.Attribute | ast.Subscript):
            target = target.value
        return target.id if isinstance(target, ast.Name) else None

    targets = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.Delete):
            targets += node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets.append(node.target)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("setattr", "delattr"):
            targets += [ast.Attribute(value=node.args[0], attr="?")]
    while any(isinstance(t, ast.Tuple | ast.List) for t in targets):
        targets = [
            e for t in targets for e in (t.elts if isinstance(t, ast.Tuple | ast.List) else [t])
        ]
    return [ast.unparse(t) for t in targets if isinstance(t, ast.Attribute) and root(t) in imported]


def test_the_ablation_script_patches_no_other_module() -> None:
    """The script changes no attribute of the project's modules (its settings are kinds it
    registers, not patches); the check finds the patches the script once made."""
    assert module_patches((ROOT / ABLATION).read_text()) == []
    once = (
        "def f():\n    import attention\n    attention.LatentAttention.forward = g\n"
        "from smallgpt import optim\noptim.make_optimizer, x = h, 1\n"
        "from attention import apply_rope as a\nsetattr(a, 'b', 1)\n"
    )
    found = ["a.?", "attention.LatentAttention.forward", "optim.make_optimizer"]
    assert sorted(module_patches(once)) == found
