import base64
import json
from pathlib import Path

import pytest

from conftest import COMPILES, DECODE, TINY_TRAIN, cli, run

HF_SIZES = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")  # the rest as GPT-2
TINY = ["--n_layer=1", "--n_head=4", "--n_embd=32", "--block_size=16", "--device=cpu"]


def json_rows(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def test_decode_bench_runs_and_reports_every_setting() -> None:
    r = run(
        [
            "bench.py",
            "--mode=decode",
            *TINY,
            "--vocab_size=50",
            "--kv_heads=[4,2,1]",
            "--kv_lora_ranks=[12]",
            "--new_tokens=[8,20]",
            "--batch_sizes=[1,2]",
            "--repeats=1",
        ]
    )
    rows = json_rows(r.stdout)
    assert [(x["n_kv_head"], x["kv_lora_rank"], x["batch"], x["new_tokens"]) for x in rows] == [
        (g, r, b, n)
        for g, r in ((4, None), (2, None), (1, None), (4, 12))
        for b in (1, 2)
        for n in (8, 20)
    ]
    for x in rows:
        G, B, ctx = x["n_kv_head"], x["batch"], min(x["new_tokens"], 16)
        if x[
            "kv_lora_rank"
        ]:  # MLA (learned positions: no rotary key): a latent of 12 a token and layer
            assert x["attention"] == "MLA" and x["kv_cache_bytes"] == 1 * B * ctx * 12 * 4
            q, kv = 32 * 32, 32 * 12 + 12 * 2 * 32  # c_q; kv_a, kv_b
            assert x["weight_bytes"] == 4 * (q + kv + 32 * 32 + 8 * 32 * 32 + 50 * 32)
        else:
            assert (
                x["kv_cache_bytes"] == 2 * 1 * B * G * ctx * 8 * 4
            )  # 1 layer, head_dim 8, float32
            assert x["weight_bytes"] == 4 * (32 * 32 * 2 + 2 * 32 * 8 * G + 8 * 32 * 32 + 50 * 32)
        assert x["cache_tok_s"] > 0 and x["gb_s_at_end"] > 0
        assert ("recompute_tok_s" in x) == (B == 1)
    assert "| MQA | 1 | - | 2 | 20 |" in r.stdout and "| MLA | 4 | 12 | 2 | 20 |" in r.stdout


@pytest.mark.parametrize("G", [4, 2, 1])
def test_train_bench_counts_flops_by_hand(G: int) -> None:
    r = run(
        [
            "bench.py",
            "--mode=train",
            *TINY,
            "--vocab_size=50",
            f"--n_kv_head={G}",
            "--batch_size=2",
            "--compiles=[False]",
            "--dtypes=['float32']",
            "--warmup=1",
            "--iters=2",
            "--peak_flops=1e12",
        ]
    )
    (row,) = json_rows(r.stdout)
    D, H, L, V, T = 32, 4, 1, 50, 16
    matmul = (
        L * (2 * D * D + 2 * D * (D * G // H) + 8 * D * D) + V * D
    )  # q, o, k, v (G heads), MLP, lm_head
    assert row["flops_per_token"] == 6 * matmul + 12 * L * D * T
    assert row["mfu"] == pytest.approx(row["flops_per_token"] * row["tokens_per_s"] / 1e12)
    assert row["ms_per_iter"] > 0 and row["loss"] > 0


def test_train_bench_times_each_chunk_of_a_gated_deltanet_model() -> None:
    """--chunks: a row per chunk size, its FLOPs counted by hand (the Gated DeltaNet layer's
    projections, then its chunk's and its state's products, the chunk at most the sequence)."""
    args = [*TINY, "--vocab_size=50", "--layer_pattern=D", "--batch_size=2", "--chunks=[4,64]"]
    r = run(["bench.py", "--mode=train", *args, "--compiles=[False]", "--dtypes=['float32']"])
    rows = json_rows(r.stdout)
    assert [row["chunk"] for row in rows] == [4, 64]
    D, H, V, T = 32, 4, 50, 16
    matmul = 5 * D * D + 2 * D * H + 8 * D * D + V * D  # qkv, z, o; b, a; MLP; lm_head
    for row, chunk in zip(rows, (4, T), strict=True):
        assert row["flops_per_token"] == 6 * matmul + 6 * D * (4 * chunk + 4 * D // H)
        assert row["ms_per_iter"] > 0 and row["loss"] > 0
    assert "| chunk |" in r.stdout


@COMPILES
def test_hf_bench_checks_greedy_tokens_against_hugging_face() -> None:
    r = run(
        [
            "bench.py",
            "--mode=hf",
            *[f"--{k}={v}" for k, v in DECODE.items() if k in HF_SIZES],
            "--new_tokens=[30]",
            "--dtypes=['float32']",
            "--repeats=1",
            "--device=cpu",
        ]
    )
    (row,) = json_rows(r.stdout)
    assert row["same_tokens"] is True and row["hf_tok_s"] > 0 and row["ours_tok_s"] > 0
    assert "llama.cpp skipped: pass --llama_cpp=DIR" in r.stderr and "llama_cpp_tok_s" not in row


def test_hf_bench_with_no_llama_cpp_build_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "convert_hf_to_gguf.py").write_text(
        ""
    )  # a source folder whose llama-bench was never built
    r = cli(["bench.py", "--mode=hf", *TINY, "--new_tokens=[8]", f"--llama_cpp={tmp_path}"])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    (error,) = [
        line for line in r.stderr.splitlines() if not line.startswith("# ")
    ]  # after the bench's header
    assert (
        error.startswith(f"error: --llama_cpp={tmp_path}: no ") and "build/bin/llama-bench" in error
    )


def test_gguf_check_is_skipped_in_one_line_without_llama_cpp_and_refuses_a_folder_without_it(
    tmp_path: Path,
) -> None:
    r = cli(["bench.py", "--mode=gguf", f"--out_dir={tmp_path}"])
    assert r.returncode == 0 and r.stdout.startswith(
        "# gguf check skipped: pass --llama_cpp=DIR"
    ), r.stdout
    r = cli(["bench.py", "--mode=gguf", f"--out_dir={tmp_path}", f"--llama_cpp={tmp_path}"])
    assert (
        r.returncode == 2
        and "no convert_hf_to_gguf.py and build/bin/llama-simple there" in r.stderr
    ), r.stderr


def test_gguf_check_refuses_a_char_level_run_before_llama_cpp_runs(
    pycode_small: Path, tmp_path: Path
) -> None:
    from test_export import fake_llama_cpp

    calls = fake_llama_cpp(tmp_path / "llama")
    run(
        [
            "train.py",
            f"--dataset={pycode_small}",
            f"--out_dir={tmp_path / 'run'}",
            *TINY_TRAIN,
            "--max_iters=1",
            "--eval_interval=1",
        ]
    )
    r = cli(
        [
            "bench.py",
            "--mode=gguf",
            f"--out_dir={tmp_path / 'run'}",
            f"--llama_cpp={tmp_path / 'llama'}",
            "--new_tokens=[4]",
        ]
    )
    assert r.returncode == 2 and r.stderr.startswith(
        "error: GGUF needs a byte-level BPE vocabulary"
    ), r.stderr
    assert (
        len(r.stderr.splitlines()) == 1 and not calls.exists()
    )  # neither the converter nor llama-simple ran


def test_tokenizer_files_for_llama_cpp_encode_as_tiktoken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama.cpp's converter reads GPT-2's tokenizer from vocab.json and merges.txt through
    transformers: the files made from a tiktoken BPE must encode text as tiktoken does."""
    from transformers import AutoTokenizer, GPT2Config

    from smallgpt import bench_peers
    from smallgpt.tokenizer import gpt2_encoding

    pieces = [bytes([i]) for i in range(256)] + [
        b"th",
        b"he",
        b"the",
        b" the",
        b"in",
        b"ing",
        b" th",
        b"  ",
    ]
    bpe = tmp_path / "tiny.tiktoken"
    bpe.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(pieces)))
    monkeypatch.setenv("GPT2_BPE_FILE", str(bpe))
    bench_peers.write_gpt2_tokenizer(tmp_path)
    GPT2Config().save_pretrained(tmp_path)
    text = "the thing in the   theatre, breathing <|endoftext|> ünïcode\n\nthe"
    ids = AutoTokenizer.from_pretrained(tmp_path).encode(text)
    assert ids == gpt2_encoding().encode(text, allowed_special="all")
    assert len(ids) < len(text.encode())  # merges were used


def test_nanogpt_bench_without_a_checkout_is_one_line(tmp_path: Path) -> None:
    r = cli(
        [
            "bench.py",
            "--mode=nanogpt",
            f"--nanogpt_dir={tmp_path}",
            *TINY,
            "--warmup=1",
            "--iters=1",
        ]
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"no nanoGPT checkout at {tmp_path}" in r.stderr and "--nanogpt_dir" in r.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mode=nanogpt"], "--mode=nanogpt needs --nanogpt_dir="),
        (["--mode=nanogpt", f"--nanogpt_dir={Path(__file__).parents[1]}"], "is this repository"),
        (["--mode=train", "--iters=0"], "iters=0 must be positive"),
        (["--new_tokens=[0]"], "new_tokens=[0] must all be positive"),
        (["--new_tokens=[]"], "new_tokens=[] needs at least one value"),
        (["--batch_sizes=[0]"], "batch_sizes=[0] must all be positive"),
        (["--kv_heads=[3]"], "n_head=4 is not divisible by n_kv_head=3"),
        (["--mode=hf", "--new_tokens=[16]"], "each must be below it"),
        (["--mode=train", "--chunks=[8]"], "chunks=[8] sizes Gated DeltaNet or Kimi Delta"),
        (["--mode=train", "--layer_pattern=D", "--chunks=[0]"], "chunks=[0] must all be"),
    ],
)
def test_bad_bench_settings_are_one_line_before_any_work(args: list[str], message: str) -> None:
    r = cli(["bench.py", *TINY, *args])
    (error,) = [
        line for line in r.stderr.splitlines() if not line.startswith("# ")
    ]  # at most the bench's header
    assert r.returncode == 2 and error.startswith("error: ") and message in error


# what decode mode measures, as a refusal says it
DECODING = "which measures decoding by fresh models of train.py's keys, not a run"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--mode=decode", "--out_dir=RUN"],
            f"--out_dir=RUN is not read by --mode=decode, {DECODING} (--mode=int8 or gguf reads "
            "it): leave it out",
        ),
        (["--out_dir=RUN"], "--out_dir=RUN is not read by --mode=decode"),  # the default mode
        (["--mode=train", "--compile=True"], "--compile=True is not read by --mode=train"),
        (["--mode=train", "--dtype=float32"], "(it reads --dtypes): leave it out"),
        (["--mode=decode", "--n_kv_head=2"], "(it reads --kv_heads): leave it out"),
        (["--mode=decode", "--chunks=[4]"], "--chunks=[4] is not read by --mode=decode"),
        (["--mode=train", "--repeats=2"], "(--mode=decode or hf reads it)"),
        (["--mode=memory", "--n_layer=2"], "--n_layer=2 is not read by --mode=memory"),
        (["--mode=hf", "--pos_encoding=rope"], "--pos_encoding=rope is not read by --mode=hf"),
        (["--mode=gguf", "--device=cpu"], "--device=cpu is not read by --mode=gguf"),
        (["--mode=int8", "--n_layer=2"], "--n_layer=2 is not read by --mode=int8"),
        (["--mode=recipes", "--configs=[a.py]", "--out_dir=x"], "--out_dir=x is not read by"),
        (
            ["--layer_pattern=D", "--kv_heads=[2]"],
            "kv_heads=[2], kv_lora_ranks=[] vary the attention layers' K/V and "
            "layer_pattern='D' on n_layer=6 has none",
        ),
    ],
)
def test_a_flag_the_mode_does_not_read_is_one_line_before_any_work(
    args: list[str], message: str
) -> None:
    """--mode=decode --out_dir=RUN would time a fresh model of train.py's keys, not the run: each
    mode reads its own keys (bench.MODES), and a flag of another is refused, saying which reads it
    (train.py's config files are left alone: their keys are train.py's)."""
    r = cli(["bench.py", *args])
    (error,) = [line for line in r.stderr.splitlines() if not line.startswith("# ")]
    assert r.returncode == 2 and error.startswith("error: ") and message in error, r.stderr


def test_every_key_is_read_by_some_mode_and_a_model_without_attention_decodes_as_itself() -> None:
    """bench.MODES names only real keys and reads each somewhere (so a refusal can say where); a
    model of Gated DeltaNet layers alone is decoded as it is, once, its attention 'none' (not MHA,
    GQA and MQA variants that differ in nothing)."""
    import dataclasses

    import bench
    from smallgpt.configs import TrainConfig

    fields = dataclasses.fields(bench.BenchConfig) + dataclasses.fields(TrainConfig)
    keys = {f.name for f in fields} - {"mode"}
    read = frozenset().union(*(mode.reads for mode in bench.MODES.values()))
    assert read == keys
    r = cli(["bench.py", *TINY, "--layer_pattern=D", "--vocab_size=50", "--new_tokens=[4]"])
    rows = json_rows(r.stdout)
    assert [(x["attention"], x["layers"], x["batch"]) for x in rows] == [
        ("none", "D", 1),
        ("none", "D", 8),
    ]


def test_memory_bench_reports_ddp_and_fsdp_bytes_per_process() -> None:
    r = cli(["bench.py", "--mode=memory", "--world_sizes=[2,8]"])
    rows = json_rows(r.stdout)
    assert [x["model"] for x in rows] == ["gpt2", "gpt2-medium", "gpt2-xl"]
    assert rows[0]["params"] == 124_373_760  # GPT-2 small without biases, lm_head tied, vocab 50304
    for x in rows:
        assert x["ddp_gib"] == 16 * x["params"] / 2**30
        assert (
            x["ddp_gib"] / 2 <= x["fsdp_2_gib"] < x["ddp_gib"] / 2 * 1.01
        )  # shards padded to whole rows
        assert x["ddp_gib"] / 8 <= x["fsdp_8_gib"] < x["ddp_gib"] / 8 * 1.01
    assert "| gpt2-xl | 1,556,840,000 |" in r.stdout


def test_recipes_bench_trains_each_config_and_reports_its_final_val_loss(
    pycode_small: Path, tmp_path: Path
) -> None:
    for name, lr in (("a", 1e-4), ("b", 3e-3)):
        (tmp_path / f"{name}.py").write_text(
            f"learning_rate = {lr}\nmax_iters = 30\nlr_decay_iters = 30\n"
            f"warmup_iters = 3\neval_interval = 30\n"
        )
    from conftest import TINY_TRAIN

    r = run(
        [
            "bench.py",
            "--mode=recipes",
            f"--configs=[{tmp_path / 'a.py'},{tmp_path / 'b.py'}]",
            f"--dataset={pycode_small}",
            *[a for a in TINY_TRAIN if not a.startswith("--learning_rate")],
        ]
    )
    a, b = json_rows(r.stdout)
    assert (a["config"], b["config"], a["iters"], b["eval_iters"]) == (
        str(tmp_path / "a.py"),
        str(tmp_path / "b.py"),
        30,
        4,
    )
    assert (
        b["val_loss"] < a["val_loss"] - 0.1
    )  # the learning rates differ 30x: the files were read, each its own
    assert b["vs_first"] == pytest.approx(b["wall_s"] / a["wall_s"]) and a["vs_first"] == 1.0
    r = cli(["bench.py", "--mode=recipes"])
    assert r.returncode == 2 and "--mode=recipes needs --configs=" in r.stderr
