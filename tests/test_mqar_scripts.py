"""The scripts the docs point users to on MQAR, scripts/zoology_mqar.py and
scripts/mla_mqar_ablation.py: the figure they draw, the folders they take (only their own), the
datasets they reuse (only those of their settings), and every mistake one line before any work,
with nothing written (issue 66)."""

import csv
import json
from pathlib import Path

import pytest

from conftest import ROOT, Result, cli, run
from smallgpt.data import load_meta

ZOOLOGY = "scripts/zoology_mqar.py"
# a small figure: 2 pairs in examples of 12 tokens, 8 keys, 8 values, 300 training examples
SMALL = ["--pairs=[2]", "--widths=[16]", "--seq_len=12", "--key_vocab=8", "--value_vocab=8"]
SMALL += ["--train_examples=300", "--max_iters=4"]


def refused(r: Result, *says: str) -> None:
    """r is one `error:` line and exit 2, holding each of says."""
    one_line = r.stderr.startswith("error: ") and r.stderr.count("\n") == 1
    assert r.returncode == 2 and one_line, r.stderr
    for text in says:
        assert text in r.stderr, r.stderr


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
