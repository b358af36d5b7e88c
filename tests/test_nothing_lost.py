"""Nothing of the user's is lost: every delete names only what the project wrote (a user's file put
beside it survives), temp files have unique names of the project's own pattern and stale ones are
removed under their folder's lock, a command writes only into a folder of its kind, a run refuses
before training what it would refuse after, and a setting that would change nothing is one line
naming the key."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY_TRAIN, cli, run, tiny_model
from export import ExportConfig, check_destinations
from smallgpt.atomic import TEMP_MARK, atomic_open, folder_lock, remove_stale_temps, temp_path
from smallgpt.checkpoint import keep_copy, save_checkpoint
from smallgpt.data import write_dataset, writing_dataset
from smallgpt.errors import UserError
from smallgpt.sharding import prune_sharded

# what GPTConfig says of a key that only attention layers read, on a model with none
UNREAD = "is read only by global and local attention layers (L, S)"


def one_line(r: object, *parts: str) -> str:
    """The one `error:` line of a refused command, holding each of parts."""
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    (line,) = r.stderr.splitlines()
    assert line.startswith("error: ") and all(part in line for part in parts), line
    return line


def files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_keep_last_prunes_only_the_runs_own_numbered_checkpoints(tmp_path: Path) -> None:
    """A user's ckpt-0.pt, ckpt-5.pt, ckpt-best.pt and ckpt-0000003.pt.bak are never deleted, nor
    counted among the kept ones: the three newest of the run's own stay."""
    mine = ["ckpt-0.pt", "ckpt-5.pt", "ckpt-best.pt", "ckpt-0000003.pt.bak"]
    for name in mine:
        (tmp_path / name).write_text("the user's")
    model = tiny_model()
    for it in (2, 4, 6, 8, 10):
        save_checkpoint(tmp_path / "ckpt.pt", model, keep_last=3, iter_num=it)
    kept = ["ckpt-0000006.pt", "ckpt-0000008.pt", "ckpt-0000010.pt"]
    assert files(tmp_path) == sorted([*mine, *kept, "ckpt.pt"])
    assert all((tmp_path / name).read_text() == "the user's" for name in mine)
    # past seven digits the names grow, and the order is the iteration's, not the text's
    keep_copy(tmp_path / "ckpt.pt", 12_000_000, keep_last=2)
    assert files(tmp_path) == sorted([*mine, "ckpt-0000010.pt", "ckpt-12000000.pt", "ckpt.pt"])


def test_a_save_never_touches_a_users_file_of_the_old_temp_name(tmp_path: Path) -> None:
    (tmp_path / "ckpt.pt.tmp").write_text("the user's")
    save_checkpoint(tmp_path / "ckpt.pt", tiny_model(), iter_num=1)
    assert (tmp_path / "ckpt.pt.tmp").read_text() == "the user's"
    assert files(tmp_path) == ["ckpt.pt", "ckpt.pt.tmp"]


def test_temp_names_are_unique_and_only_stale_ones_of_the_pattern_are_removed(
    tmp_path: Path,
) -> None:
    names = {temp_path(tmp_path / "ckpt.pt").name for _ in range(50)}
    assert len(names) == 50 and all(n.startswith(f".ckpt.pt{TEMP_MARK}") for n in names)
    # two writers of one file at once each write their own temp, and the file is one of theirs,
    # whole
    with (
        atomic_open(tmp_path / "a.txt", "w") as first,
        atomic_open(tmp_path / "a.txt", "w") as second,
    ):
        first.write("first")
        second.write("second")
    assert (tmp_path / "a.txt").read_text() == "first"
    stale_file = tmp_path / f".ckpt.pt{TEMP_MARK}0123abcd"
    stale_folder = tmp_path / f".config.json{TEMP_MARK}89abcdef"
    stale_file.write_text("half a checkpoint")
    stale_folder.mkdir()
    (stale_folder / "part").write_text("x")
    survivors = [
        f".ckpt.pt{TEMP_MARK}notes",
        f".ckpt.pt{TEMP_MARK}0123abcdX",
        f".log.jsonl{TEMP_MARK}0123abcd",
        f"ckpt.pt{TEMP_MARK}0123abcd",
        ".ckpt.pt.tmp",
    ]
    for name in survivors:
        (tmp_path / name).write_text("the user's, or another writer's")
    remove_stale_temps(tmp_path, r"ckpt\.pt|config\.json")
    assert not stale_file.exists() and not stale_folder.exists()
    assert files(tmp_path) == sorted(["a.txt", *survivors])


def test_pruning_sharded_folders_names_only_save_shardeds(tmp_path: Path) -> None:
    for name in (
        "sharded-0000002",
        "sharded-0000004.tmp",
        "sharded-0000006",
        "sharded-mine",
        "sharded-7",
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "data").write_text("x")
    (tmp_path / "ckpt-0000006.pt").write_text("kept")
    prune_sharded(tmp_path, 8)
    assert files(tmp_path) == ["ckpt-0000006.pt", "sharded-0000006", "sharded-7", "sharded-mine"]


def test_preparing_a_dataset_again_removes_only_its_own_stale_temps(tmp_path: Path) -> None:
    data = tmp_path / "d"
    meta = {"vocab_size": 5, "tokenizer": "char", "chars": list("abcde")}
    ids = np.arange(100) % 5
    write_dataset(data, ids, ids, meta)
    (data / "notes.md").write_text("the user's")
    (data / f".train.bin{TEMP_MARK}0123abcd").write_bytes(b"a killed preparation's")
    write_dataset(data, ids[:50], ids, meta)
    assert files(data) == [".lock", "meta.json", "notes.md", "train.bin", "val.bin"]
    assert json.loads((data / "meta.json").read_text())["train_tokens"] == 50
    with folder_lock(
        data, "a test"
    ):  # a preparation while another holds the folder: refused, nothing written
        with pytest.raises(UserError, match="is in use by a test"):
            write_dataset(data, ids, ids, meta)
    assert json.loads((data / "meta.json").read_text())["train_tokens"] == 50


def test_preparing_a_dataset_again_leaves_nothing_of_the_earlier_one(tmp_path: Path) -> None:
    """A preparation that changes what a folder holds removes the earlier one's files it does not
    write itself (a BPE tokenizer.json after a char preparation, a test split, MQAR's answer
    masks, which would make plain text read as MQAR), by the list meta.json keeps, or by a
    dataset's names for a meta from before the list; a user's file stays. meta.json records the
    preparation's settings."""
    text = tmp_path / "in.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    data = tmp_path / "d2"
    prepare = ["dataset.py", f"--input={text}", f"--out_dir={data}"]
    run([*prepare, "--tokenizer=bpe", "--vocab_size=300"])
    (data / "notes.md").write_text("the user's")
    assert files(data) == [".lock", "meta.json", "notes.md", "test.bin", "tokenizer.json"] + [
        "train.bin",
        "val.bin",
    ]
    run([*prepare, "--test_fraction=0"])  # char-level, no test split
    assert files(data) == [".lock", "meta.json", "notes.md", "train.bin", "val.bin"]
    meta = json.loads((data / "meta.json").read_text())
    assert meta["tokenizer"] == "char" and meta["files"] == ["train.bin", "val.bin"]
    assert meta["settings"] == {
        "input": str(text),
        "tokenizer": "char",
        "vocab_size": None,
        "val_fraction": 0.05,
        "test_fraction": 0.0,
    }
    # an MQAR-like preparation (masks), then plain text: no mask is left to be read as answers
    ids = np.arange(100) % 5
    with writing_dataset(data, ("train.bin", "val.bin", "train_mask.bin", "val_mask.bin")) as (
        bins,
        written,
    ):
        for name, f in bins.items():
            f.write(ids.astype(np.uint16 if "mask" not in name else np.uint8).tobytes())
        written.update(vocab_size=5, dtype="uint16", train_tokens=100, val_tokens=100)
        written.update(tokenizer="char", chars=list("abcde"))
    meta = json.loads((data / "meta.json").read_text())
    del meta["files"]  # as a preparation before the list wrote it
    (data / "meta.json").write_text(json.dumps(meta))
    run(prepare)
    assert files(data) == [".lock", "meta.json", "notes.md", "test.bin", "train.bin", "val.bin"]
    assert (data / "notes.md").read_text() == "the user's"
    # a meta.json that is no dataset's (the user's): nothing beside it is taken for a preparation's
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "meta.json").write_text('{"author": "me"}')
    (mine / "test.bin").write_bytes(b"the user's")
    run(["dataset.py", f"--input={text}", f"--out_dir={mine}", "--test_fraction=0"])
    assert (mine / "test.bin").read_bytes() == b"the user's"
    # the dataset by its bare name, beside it: the line says how to give it, not to prepare it
    r = cli(["train.py", "--dataset=d2", *TINY_TRAIN], cwd=tmp_path)
    one_line(r, "no dataset at ", "data/d2 (missing meta.json)", "give its path: --dataset=./d2")


def test_an_export_without_its_list_of_files_refuses_a_users_file(tmp_path: Path) -> None:
    """An export written before smallgpt.json listed its files: the names an export can write are
    its, any other is the user's, and --overwrite refuses the folder naming it."""
    dest = tmp_path / "old"
    dest.mkdir()
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "README.md",
        "smallgpt.json",
    ):
        (dest / name).write_text("{}")
    (dest / "model-00001-of-00002.safetensors").write_text("a shard")
    cfg = ExportConfig(out_dir=str(tmp_path / "run"), to=str(dest), overwrite=True)
    assert check_destinations(cfg, dest) is True
    (dest / "eval.txt").write_text("the user's")
    with pytest.raises(
        UserError, match=r"holds an earlier export and eval\.txt, which no export wrote: move it"
    ):
        check_destinations(cfg, dest)


def test_a_log_without_a_checkpoint_is_refused_unless_it_is_this_runs(
    pycode_small: Path, tmp_path: Path
) -> None:
    """A run killed before its first save left a log and no checkpoint: the same command starts it
    again there; another run is refused before anything is written."""
    out = tmp_path / "out"
    args = [
        "train.py",
        f"--dataset={pycode_small}",
        f"--out_dir={out}",
        *TINY_TRAIN,
        "--eval_interval=2",
    ]
    run([*args, "--max_iters=2"])
    (out / "ckpt.pt").unlink()  # as if killed before its first save
    log = (out / "log.jsonl").read_bytes()
    config = (out / "config.json").read_bytes()
    one_line(
        cli([*args, "--max_iters=2", "--n_embd=64"]),
        f"{out} holds another run's log.jsonl (with no checkpoint",
    )
    one_line(cli([*args, "--max_iters=4"]), "holds another run's log.jsonl")
    assert (out / "log.jsonl").read_bytes() == log and (out / "config.json").read_bytes() == config
    run([*args, "--max_iters=2", "--init_from=auto"])  # the same run, started again in place
    assert (out / "ckpt.pt").is_file()


def test_a_leading_tilde_is_the_home_folder(pycode_small: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    args = [
        "train.py",
        f"--dataset={pycode_small}",
        "--out_dir=~/runs/x",
        *TINY_TRAIN,
        "--max_iters=0",
        "--eval_at_start=False",
    ]
    run(args, env={"HOME": str(home)})
    assert (home / "runs" / "x" / "config.json").is_file() and not (Path.cwd() / "~").exists()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # a window on no layer: the pattern's S falls on the last layer, always global
        (
            dict(n_layer=3, window=4, window_pattern="LLS"),
            "window_pattern='LLS' on n_layer=3 makes no layer local",
        ),
        (
            dict(n_layer=1, window=4, window_pattern="S"),
            "window_pattern='S' on n_layer=1 makes no layer local",
        ),
        (
            dict(block_size=16, window=16, window_pattern="SL"),
            "window=16 is not below block_size=16",
        ),
        (dict(window=4, window_pattern="ssl"), "its letters are upper case, window_pattern='SSL'"),
        (dict(window=4, window_pattern="SX"), "must be letters S (a local layer) and L"),
        # a latent no smaller than the K and V it replaces, a rotary key past the head
        (
            dict(kv_lora_rank=56, qk_rope_head_dim=8, pos_encoding="rope"),
            "caches 64 features a token, not fewer than the 64 of the K and V it replaces",
        ),
        (
            dict(kv_lora_rank=8, qk_rope_head_dim=10, pos_encoding="rope"),
            "qk_rope_head_dim=10 is wider than a head",
        ),
        # keys of a kind of layer the model does not have
        (dict(latent_norm=False), "latent_norm=False is an MLA key: set kv_lora_rank too"),
        (dict(rope_theta=500.0), "rope_theta=500.0 applies to rotary positions"),
        (dict(mlp="swiglu", gelu="tanh"), "gelu='tanh' applies to mlp='gelu'"),
        # a pattern's letters past the last layer: cut, they would name no layer
        (
            dict(layer_pattern="DDDL"),
            "layer_pattern='DDDL' has 4 letters and n_layer=2: the letters past layer 2 name no "
            "layer (the model would be 'DD', no attention layer); give at most 2 letters, "
            "e.g. 'DL'",
        ),
        (dict(layer_pattern="LLLD"), "(the model would be 'LL', no Gated DeltaNet layer)"),
        (dict(window=4, window_pattern="SSSL"), "window_pattern='SSSL' has 4 letters"),
        # a key that only attention layers read, on a model with none
        (
            dict(layer_pattern="DD", n_kv_head=1),
            f"n_kv_head=1 {UNREAD}, and layer_pattern='DD' on n_layer=2 has none: leave it out",
        ),
        (dict(layer_pattern="D", kv_lora_rank=16), f"kv_lora_rank=16 {UNREAD}"),
        (dict(layer_pattern="D", latent_norm=False), f"latent_norm=False {UNREAD}"),
        (dict(layer_pattern="D", qk_rope_head_dim=4), f"qk_rope_head_dim=4 {UNREAD}"),
        (dict(layer_pattern="D", q_lora_rank=8), f"q_lora_rank=8 {UNREAD}"),
        (dict(layer_pattern="D", qk_norm=True), f"qk_norm=True {UNREAD}"),
        (
            dict(layer_pattern="D", pos_encoding="rope", rope_theta=500.0),
            f"rope_theta=500.0 {UNREAD}",
        ),
        (
            dict(layer_pattern="D", pos_encoding="rope", rope_fraction=0.5),
            f"rope_fraction=0.5 {UNREAD}",
        ),
    ],
)
def test_a_setting_that_would_change_nothing_is_one_line_naming_it(
    overrides: dict, message: str
) -> None:
    from model import GPTConfig

    with pytest.raises(ValueError) as err:
        GPTConfig(**{"n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 32} | overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_key_no_layer_reads_is_one_problem_of_its_own_and_what_layers_read_is_kept() -> None:
    """On a model of Gated DeltaNet layers alone: a line for each attention key given and none for
    what MLA's latent resolves (its rotary key's width); an n_kv_head of n_head (its default), a
    pattern that tiles the layers, and learned positions' rotary keys (named as unused, not unread)
    as before; compare.py's all-recurrent variant (mha-d) still names its model."""
    from model import GPTConfig
    from smallgpt.variant import Variant

    base = dict(n_layer=2, n_head=4, n_embd=32, block_size=32, layer_pattern="D")
    with pytest.raises(ValueError) as err:
        GPTConfig(**base, attn_gate="element", qk_norm=True)
    assert str(err.value).count("is read only by") == 2 and "\n" not in str(err.value)
    with pytest.raises(ValueError) as err:
        GPTConfig(**base, kv_lora_rank=16, pos_encoding="rope")
    assert "kv_lora_rank=16" in str(err.value) and "qk_rope_head_dim" not in str(err.value)
    with pytest.raises(ValueError, match="rope_theta=500.0 applies to rotary positions"):
        GPTConfig(**(base | dict(layer_pattern="DL")), rope_theta=500.0)
    assert GPTConfig(**base, n_kv_head=4).attention_type == "MHA"
    assert GPTConfig(**(base | dict(n_layer=6, layer_pattern="DL"))).layer_letters == "DLDLDL"
    mha = GPTConfig(n_layer=4, n_head=4, n_embd=32, block_size=32)
    assert str(Variant.from_config(Variant.parse("mha-d").config(mha))) == "mha-d"


def test_a_list_that_names_an_item_twice_is_one_line() -> None:
    """eval.py's tasks and distances, train.py's final_evals: a repeat measures nothing new."""
    r = cli(["eval.py", "--tasks=[induction,induction]"])
    one_line(r, "tasks=['induction', 'induction'] lists 'induction' twice")
    one_line(cli(["eval.py", "--distances=[8,16,8]"]), "distances=[8, 16, 8] lists 8 twice")
    r = cli(["train.py", "--final_evals=[position,position]"])
    one_line(r, "final_evals=['position', 'position'] lists 'position' twice")


def test_the_limits_themselves_are_accepted() -> None:
    """One below each refused value builds: a window of block_size - 1, a latent one feature under
    MHA's K and V, a rotary key as wide as the head, S on the last layer but one."""
    from model import GPTConfig

    base = dict(n_layer=3, n_head=4, n_embd=32, block_size=16)
    assert GPTConfig(**base, window=15, window_pattern="LS").layer_windows == [None, 15, None]
    latent = GPTConfig(**base, kv_lora_rank=55, qk_rope_head_dim=8, pos_encoding="rope")
    assert latent.kv_cache_bytes(1, 1) == 3 * 63 * 4
    assert GPTConfig(**base, kv_lora_rank=8, qk_rope_head_dim=8, pos_encoding="rope").rope_dim == 8


def test_final_evals_a_dataset_cannot_take_are_refused_before_training(
    pycode_small: Path, tmp_path: Path
) -> None:
    """mqar on a text dataset, induction on a vocabulary too small for its segment, or a context too
    short for one copy: one line, and nothing trained or written."""
    tiny = tmp_path / "tiny"
    ids = np.arange(400) % 6
    write_dataset(tiny, ids, ids, {"vocab_size": 6, "tokenizer": "char", "chars": list("abcdef")})
    train = ["train.py", *TINY_TRAIN, "--max_iters=2", "--eval_interval=2"]
    for dataset, extra, message in [
        (pycode_small, ["--final_evals=[position,mqar]"], "the mqar task reads an MQAR dataset"),
        (
            tiny,
            ["--final_evals=[induction]"],
            "needs 16 distinct tokens (the segment's and as many for the "
            "filler), but the vocabulary has 6",
        ),
        (
            pycode_small,
            ["--final_evals=[induction]", "--block_size=6"],
            "so it needs block_size >= 8, not 6",
        ),
    ]:
        out = tmp_path / f"out-{len(os.listdir(tmp_path))}"
        one_line(cli([*train, f"--dataset={dataset}", f"--out_dir={out}", *extra]), message)
        assert not out.exists() or files(out) == []


@pytest.mark.parametrize(
    ("script", "flag"),
    [
        ("train.py", "--learning_rate=nan"),
        ("train.py", "--min_lr=-inf"),
        ("train.py", "--max_iters=inf"),
        ("sample.py", "--temperature=nan"),
        ("sample.py", "--top_p=Infinity"),
    ],
)
def test_a_number_that_is_not_finite_says_so(script: str, flag: str) -> None:
    key, value = flag[2:].split("=")
    one_line(cli([script, flag]), f"{key}={value} (from flag {flag}) must be a finite number")


def test_an_unwritable_destination_is_named_as_the_user_gave_it(tmp_path: Path) -> None:
    """A folder the system refuses to write into (here /sys, refused even to root): the line names
    the folder or file given, never the temp name written first."""
    if os.access("/sys", os.W_OK) and not Path("/sys").is_mount():
        pytest.skip("/sys is writable here: no folder refuses writes")
    with pytest.raises(UserError) as err:
        with atomic_open("/sys/report.md", "w") as f:
            f.write("x")
    assert str(err.value).startswith("cannot write /sys/report.md (") and TEMP_MARK not in str(
        err.value
    )
    with pytest.raises(UserError, match=r"^cannot write /sys/ckpt\.pt \("):
        save_checkpoint("/sys/ckpt.pt", tiny_model(), iter_num=1)


def test_bench_replaces_only_the_links_it_made(pycode_small: Path, tmp_path: Path) -> None:
    from smallgpt.bench_peers import nanogpt_dataset

    name = nanogpt_dataset(tmp_path, str(pycode_small))
    linked = tmp_path / "data" / name
    assert (linked / "train.bin").is_symlink()
    assert nanogpt_dataset(tmp_path, str(pycode_small)) == name  # again: its own links replaced
    (linked / "val.bin").unlink()
    (linked / "val.bin").write_bytes(b"the user's own tokens")
    with pytest.raises(UserError, match="is a file, not the link"):
        nanogpt_dataset(tmp_path, str(pycode_small))
    assert (linked / "val.bin").read_bytes() == b"the user's own tokens"
    shutil.rmtree(linked)


def test_a_comparison_writes_only_into_a_folder_of_its_kind(
    pycode_small: Path, tmp_path: Path
) -> None:
    """compare.py into a dataset, a run or an export is refused before anything is written; a
    comparison's folder (marked by compare.json when made) takes no run, dataset or export of its
    own."""
    run_dir = tmp_path / "run"
    run(
        [
            "train.py",
            f"--dataset={pycode_small}",
            f"--out_dir={run_dir}",
            *TINY_TRAIN,
            "--max_iters=0",
            "--eval_at_start=False",
        ]
    )
    export = tmp_path / "export"
    export.mkdir()
    (export / "smallgpt.json").write_text("{}")
    compare = ["compare.py", f"--dataset={pycode_small}", *TINY_TRAIN, "--mode=report"]
    for folder, kind in [(pycode_small, "a dataset"), (run_dir, "a run"), (export, "an export")]:
        before = files(folder)
        one_line(cli([*compare, f"--out_dir={folder}"]), f"{folder} holds {kind}, not a comparison")
        assert files(folder) == before
    root = tmp_path / "sweep"
    root.mkdir()
    (root / "compare.json").write_text('{"kind": "a comparison"}')
    one_line(
        cli(["train.py", f"--dataset={pycode_small}", f"--out_dir={root}", *TINY_TRAIN]),
        f"{root} holds a comparison, not a run",
    )
    (tmp_path / "in.txt").write_text("hello world " * 100)
    one_line(
        cli(["dataset.py", f"--input={tmp_path / 'in.txt'}", f"--out_dir={root}"]),
        f"{root} holds a comparison, not a dataset",
    )
    assert files(root) == ["compare.json"]


def test_a_comparison_adopts_only_an_empty_folder_or_its_own(
    pycode_small: Path, tmp_path: Path
) -> None:
    """A folder of the user's (a report.md and a speed.json of theirs, or any file) is refused in
    one line before any work, in every mode that writes; a folder marked by compare.json whose
    speed.json is not the sweep's record is refused before any run trains, not after all of them;
    an empty folder is taken, and nothing of the user's is replaced."""
    compare = ["compare.py", f"--dataset={pycode_small}", *TINY_TRAIN, "--kv_heads=[4]"]
    user = tmp_path / "c2"
    user.mkdir()
    (user / "report.md").write_text("my notes")
    (user / "speed.json").write_text('{"mine": [1.0]}')
    for mode in ("train", "report", "all"):
        line = one_line(cli([*compare, f"--out_dir={user}", f"--mode={mode}"]))
        assert f"{user} holds files this tool did not write (report.md, speed.json), not a " in line
        assert files(user) == ["report.md", "speed.json"]
    assert (user / "report.md").read_text() == "my notes"
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")  # a name compare.py never writes: refused too
    one_line(cli([*compare, f"--out_dir={other}"]), "holds files this tool did not write (notes")
    # a sweep's folder from before sweeps marked them: the line says how to mark it
    (other / "mha-s1337").mkdir()
    (other / "mha-s1337" / "log.jsonl").write_text("")
    line = one_line(cli([*compare, f"--out_dir={other}", "--mode=report"]))
    assert line.endswith(f'mark it: echo \'{{"kind": "a comparison"}}\' > {other}/compare.json')
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "compare.json").write_text('{"kind": "a comparison"}')
    for text, why in (("{not json", "is not JSON"), ("[1, 2]", "is not a record of decode")):
        (sweep / "speed.json").write_text(text)
        one_line(cli([*compare, f"--out_dir={sweep}"]), f"{sweep / 'speed.json'} {why}")
        assert files(sweep) == ["compare.json", "speed.json"]  # no run started


def test_a_conversion_that_would_convert_nothing_is_refused(tmp_path: Path) -> None:
    """--convert=True converts MHA into the all-global variants and hybrids of them: with only
    local or gated variants (a hybrid with a local layer too) beside MHA there is nothing to
    convert; convert_methods with only MLA targets (converted by SVD) or MHA hybrids (copied)
    would pool nothing."""
    compare = ["compare.py", *TINY_TRAIN, f"--out_dir={tmp_path / 'c'}", "--convert=True"]
    for variants in ("[mha,mha-dsl8]", "[mha,mha-sl8,mha-gate]"):
        one_line(
            cli([*compare, f"--variants={variants}", "--mode=plan"]),
            "convert=True converts MHA into the variants of all-global attention",
            "'mha-dsl8']" if "dsl" in variants else "'mha-gate']",
            "has none besides mha",
        )
    for variants in ("[mha,mla32]", "[mha,mha-dl]"):
        one_line(
            cli([*compare, f"--variants={variants}", "--convert_methods=[first]", "--mode=plan"]),
            "convert_methods pool K/V heads for gqa and mqa targets",
        )
    assert not (tmp_path / "c").exists()


def test_a_failed_write_and_a_released_lock_remove_only_their_own(tmp_path: Path) -> None:
    """atomic_open deletes its own temp on an error (the file and a user's file beside it stay);
    folder_lock removes the folder it made only while that holds nothing but its lock."""
    (tmp_path / "report.md").write_text("the last report")
    (tmp_path / "notes.md").write_text("the user's")
    with pytest.raises(RuntimeError, match="half way"):
        with atomic_open(tmp_path / "report.md", "w") as f:
            f.write("half a report")
            raise RuntimeError("half way")
    assert files(tmp_path) == ["notes.md", "report.md"]
    assert (tmp_path / "report.md").read_text() == "the last report"
    made = tmp_path / "new"
    with folder_lock(made, "a test"):
        pass
    assert not made.exists()  # made for the lock, left empty: gone
    with folder_lock(made, "a test"):
        (made / "mine.txt").write_text("the user's, written while it was locked")
    assert files(made) == [".lock", "mine.txt"]


def test_an_edited_list_of_files_never_reaches_outside_the_export(tmp_path: Path) -> None:
    """smallgpt.json naming a path outside the export, or a folder inside it: the folder is refused,
    and a path is never taken as one of the export's files."""
    dest = tmp_path / "old"
    dest.mkdir()
    (tmp_path / "victim.txt").write_text("the user's")
    (dest / "config.json").write_text("{}")
    listed = ["config.json", "../victim.txt", "..", "sub", "smallgpt.json"]
    (dest / "smallgpt.json").write_text(json.dumps({"files": listed}))
    cfg = ExportConfig(out_dir=str(tmp_path / "run"), to=str(dest), overwrite=True)
    (dest / "sub").mkdir()
    with pytest.raises(UserError, match=r"holds an earlier export and sub, which no export wrote"):
        check_destinations(cfg, dest)
    (dest / "sub").rmdir()
    assert check_destinations(cfg, dest) is True
    from export import remove_export

    remove_export(dest)
    assert not dest.exists() and (tmp_path / "victim.txt").read_text() == "the user's"


def test_a_temp_name_taken_already_is_refused_and_left_alone(tmp_path: Path, monkeypatch) -> None:
    """Should a fresh temp name be taken (a user's file of the pattern), the write fails in one
    line and that file is neither overwritten nor deleted."""
    import secrets

    monkeypatch.setattr(secrets, "token_hex", lambda n: "0123abcd")
    taken = tmp_path / f".report.md{TEMP_MARK}0123abcd"
    taken.write_text("the user's")
    with pytest.raises(UserError, match=r"cannot write .*report\.md \(File exists\)"):
        with atomic_open(tmp_path / "report.md", "w") as f:
            f.write("x")
    assert taken.read_text() == "the user's" and not (tmp_path / "report.md").exists()


def test_a_run_starting_in_a_folder_another_is_starting_in_is_told_it_is_in_use(
    tmp_path: Path,
) -> None:
    """Between another run's config.json and its log, the folder is not yet a run's: the second
    run is told the folder is in use (the real cause), not that it holds other files; with the
    lock let go, the same folder is refused for what it holds."""
    from smallgpt.atomic import check_writes_into

    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")  # the first run's, before its log
    with folder_lock(out, "train.py (a test)"):
        with pytest.raises(UserError, match=r"out is in use by train.py \(a test\) \(pid "):
            check_writes_into(out, "a run", ("ckpt.pt", "log.jsonl", "config.json"))
    with pytest.raises(UserError, match="holds other files, not a run; its config.json would be"):
        check_writes_into(out, "a run", ("ckpt.pt", "log.jsonl", "config.json"))
