import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from configurator import parse_config
from conftest import ROOT, cli
from smallgpt.errors import UserError


@dataclass(slots=True)
class Cfg:
    batch_size: int = 12
    learning_rate: float = 1e-3
    compile: bool = False
    out_dir: str = "out"
    n_kv_head: int | None = None
    run_name: str | None = None
    tags: list[str] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)


def test_overrides_are_typed() -> None:
    cfg = parse_config(
        Cfg,
        [
            "--batch_size=32",
            "--learning_rate=3",
            "--compile=True",
            "--out_dir=out-x",
            "--n_kv_head=2",
            "--run_name=None",
            "--tags=['a', 'b']",
        ],
    )
    assert cfg == Cfg(32, 3.0, True, "out-x", 2, None, ["a", "b"])
    assert isinstance(cfg.learning_rate, float)
    cfg = parse_config(
        Cfg,
        ["--compile=false", "--out_dir=123", "--run_name=exp=1", "--tags=x,y", "--n_kv_head=None"],
    )
    got = (cfg.compile, cfg.out_dir, cfg.run_name, cfg.tags, cfg.n_kv_head)
    assert got == (False, "123", "exp=1", ["x", "y"], None)
    assert [parse_config(Cfg, [f"--sizes={v}"]).sizes for v in ("3", "3,", "[3, 1]")] == [
        [3],
        [3],
        [3, 1],
    ]


def test_config_files_then_flags_in_order(tmp_path: Path) -> None:
    f = tmp_path / "c.py"
    f.write_text("import math\nbatch_size = 4\nlearning_rate = math.sqrt(4) / 1000\n_private = 1\n")
    cfg = parse_config(Cfg, [str(f), "--batch_size=8"])
    assert (cfg.batch_size, cfg.learning_rate) == (8, 0.002)
    assert parse_config(Cfg, ["--batch_size=8", str(f)]).batch_size == 4


@pytest.mark.parametrize(
    ("argv", "pieces"),
    [
        (["--batch_sise=3"], ["unknown config key 'batch_sise'", "did you mean batch_size"]),
        (["--batch_size=abc"], ["batch_size=abc", "expected int", "got str", "--batch_size=abc"]),
        (["--batch_size=1.5"], ["batch_size=1.5", "expected int", "got float"]),
        (["--compile=maybe"], ["compile=maybe", "expected bool"]),
        (["--learning_rate=fast"], ["learning_rate=fast", "expected float"]),
        (["--n_kv_head=two"], ["n_kv_head=two", "expected int or None"]),
        (["--batch_size"], ["--batch_size needs a value"]),
        (["--sizes=True"], ["sizes=True", "expected list[int]", "got bool"]),
        (["no/such/config.py"], ["config file no/such/config.py not found"]),
    ],
)
def test_bad_arguments_give_one_clear_line(argv: list[str], pieces: list[str]) -> None:
    with pytest.raises(UserError) as err:
        parse_config(Cfg, argv)
    msg = str(err.value)
    assert "\n" not in msg
    for piece in pieces:
        assert piece in msg


def test_keys_from_files_are_checked_like_flags(tmp_path: Path) -> None:
    f = tmp_path / "bad.py"
    f.write_text("learning_rat = 0.1\n")
    with pytest.raises(
        UserError,
        match=r"unknown config key 'learning_rat' \(from config file .*bad.py\); did you "
        r"mean learning_rate",
    ):
        parse_config(Cfg, [str(f)])
    f.write_text("compile = 'yes'\n")
    with pytest.raises(UserError, match="expected bool"):
        parse_config(Cfg, [str(f)])
    f.write_text("batch_size = (\n")
    with pytest.raises(UserError, match=r"config file .*bad.py line 1: '\(' was never closed"):
        parse_config(Cfg, [str(f)])
    f.write_bytes(b"out_dir = 'd\xe9'\n")  # latin-1
    with pytest.raises(UserError, match=r"config file .*bad.py is not UTF-8 text"):
        parse_config(Cfg, [str(f)])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--n_kv_heads=2"],
            (
                "error: unknown config key 'n_kv_heads' (from flag --n_kv_heads=2); "
                "did you mean n_kv_head"
            ),
        ),
        (
            ["--batch_size=abc"],
            "error: batch_size=abc (from flag --batch_size=abc) has the wrong type: expected int",
        ),
        (
            ["--n_head=6", "--n_kv_head=4", "--n_embd=48"],
            "n_head=6 must be divisible by n_kv_head=4",
        ),
        (["--n_head=6", "--n_embd=50"], "n_embd=50 must be divisible by n_head=6"),
        (["--batch_size=0"], "batch_size=0 must be positive"),
        (["--block_size=-8"], "block_size=-8 must be positive"),
        (["--nonfinite=ignore"], "nonfinite='ignore' must be 'stop' or 'skip'"),
        (["config/nope.py"], "error: config file config/nope.py not found"),
    ],
)
def test_scripts_print_one_error_line_and_exit_2(args: list[str], message: str) -> None:
    r = cli(["train.py", *args])
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert message in r.stderr


@pytest.mark.parametrize(
    "path", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "config").rglob("*.py"))
)
def test_every_shipped_config_file_parses(path: str) -> None:
    from train import TrainConfig

    cfg = parse_config(TrainConfig, [path])
    assert cfg.model_config(vocab_size=100).n_layer >= 1


def test_help_lists_the_keys_and_defaults() -> None:
    r = cli(["train.py", "--help"])
    assert (
        r.returncode == 0
        and "n_kv_head" in r.stdout
        and "learning_rate" in r.stdout
        and "= 0.001" in r.stdout
    )
    for script, own in (
        ("compare.py", "kv_heads"),
        ("bench.py", "new_tokens"),
    ):  # their keys, then train.py's
        r = cli([script, "-h"])
        assert r.returncode == 0 and r.stdout.index(own) < r.stdout.index(
            "TrainConfig:"
        ) < r.stdout.index("n_kv_head")


def test_train_config_has_every_model_key_and_passes_it_on() -> None:
    """TrainConfig takes its model keys from GPTConfig itself: every GPTConfig field is a key (with
    train.py's own defaults where it sets them) and reaches the model config."""
    from model import GPTConfig
    from train import TrainConfig

    model_keys = [f.name for f in dataclasses.fields(GPTConfig)]
    assert model_keys == [f.name for f in dataclasses.fields(TrainConfig)][-len(model_keys) :]
    cfg = parse_config(
        TrainConfig, ["--rope_theta=500", "--gelu=tanh", "--n_kv_head=2", "--pos_encoding=rope"]
    )
    mc = cfg.model_config(vocab_size=77)
    assert (mc.rope_theta, mc.gelu, mc.n_kv_head, mc.pos_encoding, mc.vocab_size) == (
        500.0,
        "tanh",
        2,
        "rope",
        77,
    )
    assert (TrainConfig().n_layer, TrainConfig().bias, TrainConfig().vocab_size) == (
        6,
        False,
        None,
    )  # train.py's
    with pytest.raises(UserError, match="gelu='relu' must be 'exact' or 'tanh'"):
        parse_config(TrainConfig, ["--gelu=relu"])
