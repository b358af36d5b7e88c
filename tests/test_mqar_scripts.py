"""The scripts the docs point users to on MQAR, scripts/zoology_mqar.py and
scripts/mla_mqar_ablation.py: the figure they draw, the folders they take (only their own), the
datasets they reuse (only those of their settings), and every mistake one line before any work,
with nothing written (issue 66)."""

import csv
import json
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, Result, cli, run
from model import GPT, GPTConfig
from smallgpt.checkpoint import save_checkpoint
from smallgpt.data import load_meta

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
