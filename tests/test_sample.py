import base64
import io
import os
import re
import zipfile
from pathlib import Path

import pytest
import torch

from conftest import (
    COMPILES,
    DECODE,
    VARIANTS,
    Result,
    allowed,
    cli,
    distinct,
    lively,
    run,
    sharpened,
)
from model import GPT, GPTConfig
from smallgpt.checkpoint import load_checkpoint, model_from_checkpoint, save_checkpoint
from smallgpt.generation import generate
from smallgpt.tokenizer import CharTokenizer

CHARS = CharTokenizer.from_text("".join(chr(c) for c in range(32, 127)) + "\n")


def make_checkpoint(
    out: Path,
    n_kv_head: int,
    pos_encoding: str = "learned",
    block_size: int = 64,
    context_bound: bool = False,
) -> Path:
    """A random model's checkpoint; context_bound: a lively one (conftest.lively), whose text
    follows its window."""
    torch.manual_seed(n_kv_head)
    cfg = GPTConfig(
        block_size=block_size,
        vocab_size=len(CHARS.chars),
        n_layer=2,
        n_head=4,
        n_kv_head=n_kv_head,
        n_embd=32,
        pos_encoding=pos_encoding,
    )
    out.mkdir(parents=True, exist_ok=True)
    model = lively(GPT(cfg)) if context_bound else GPT(cfg)
    save_checkpoint(out / "ckpt.pt", model, iter_num=0, data_meta=CHARS.meta())
    return out


def sample(out: Path, *args: str) -> Result:
    return run(["sample.py", f"--out_dir={out}", "--device=cpu", *args])


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_with_and_without_cache_agree(variant: str, tmp_path: Path) -> None:
    """Through sample.py, a lively checkpoint (its text follows its window: one off by one changes
    it)."""
    out = make_checkpoint(tmp_path, VARIANTS[variant], "rope", block_size=32, context_bound=True)
    args = [
        "--start=def f(x):",
        "--temperature=0",
        "--max_new_tokens=60",
    ]  # 60 > block_size: the window slides
    cached, recomputed = sample(out, *args).stdout, sample(out, *args, "--kv_cache=False").stdout
    assert cached == recomputed and len(cached) == len("def f(x):") + 60 + 1
    assert (
        distinct(cached[33:-1]) >= 6
    )  # decoded from slid windows (33 characters on), not one repeated
    batch = sample(out, *args, "--num_samples=3").stdout
    assert batch.split("---------------\n")[:3] == [cached] * 3


@COMPILES
def test_compiled_step_writes_the_eager_text(tmp_path: Path) -> None:
    """--compile=True (the one-token step compiled by AOTInductor) samples what the eager step does,
    greedy past block_size and drawn with a seed; compiling it (autotuning the products) prints
    nothing of its own, and the speed it reports leaves the compiling out."""
    save_checkpoint(
        tmp_path / "ckpt.pt", GPT(GPTConfig(**DECODE)), iter_num=0, data_meta=CHARS.meta()
    )
    for args in (
        ["--temperature=0", "--max_new_tokens=70"],
        ["--temperature=1.0", "--top_k=None", "--seed=3"],
    ):
        eager, compiled = (
            sample(
                tmp_path,
                "--start=def f(x):",
                "--max_new_tokens=50",
                "--dtype=float32",
                *args,
                f"--compile={c}",
            )
            for c in (False, True)
        )  # auto may pick bf16 for the compiled
        assert compiled.stdout == eager.stdout and len(eager.stdout) > 50
        assert "AUTOTUNE" not in compiled.stderr
        # its speed told apart from the compiling (or loading) that the second step waits for
        assert re.search(r"compiled step ready after [\d.]+ s, then [\d,]+ tok/s", compiled.stderr)
        assert "compiled step" not in eager.stderr


def test_same_seed_same_text_other_seed_other_text(tmp_path: Path) -> None:
    out = make_checkpoint(tmp_path, 2)
    args = ["--start=x", "--temperature=1.0", "--top_k=None", "--max_new_tokens=40"]
    a, b, c = (sample(out, *args, f"--seed={s}").stdout for s in (1, 1, 2))
    assert a == b and a != c


def test_top_k_1_is_greedy(tmp_path: Path) -> None:
    out = make_checkpoint(tmp_path, 1)
    args = ["--start=import", "--max_new_tokens=30"]
    assert (
        sample(out, *args, "--top_k=1", "--temperature=1.0").stdout
        == sample(out, *args, "--temperature=0").stdout
    )


def test_prompts_of_different_lengths_in_one_batch(tmp_path: Path) -> None:
    out = make_checkpoint(tmp_path, 2, "rope")
    prompts = ["a", "def main():", "class Foo(Bar):  #", "x = 1"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    args = ["--temperature=0", "--max_new_tokens=25"]
    batch = sample(out, f"--start=LINES:{tmp_path / 'prompts.txt'}", *args).stdout.split(
        "\n---------------\n"
    )
    for prompt, text in zip(prompts, batch, strict=False):
        assert text == sample(out, f"--start={prompt}", *args).stdout.rstrip("\n")
    assert len(batch) == len(prompts) + 1 and batch[-1] == ""


def test_stop_string_ends_the_sample(tmp_path: Path) -> None:
    out = make_checkpoint(tmp_path, 4)
    args = ["--start=ab", "--temperature=0", "--max_new_tokens=40"]
    full = sample(out, *args).stdout.rstrip("\n")
    stop = full[6:8]  # characters the model produces after 4 new ones
    stopped = sample(out, *args, f"--stop={stop}").stdout.rstrip("\n")
    assert stopped == full[: full.index(stop, 2) + len(stop)]
    assert len(stopped) < len(full)


def test_prompt_from_file(tmp_path: Path) -> None:
    out = make_checkpoint(tmp_path, 2)
    (tmp_path / "p.txt").write_text("for i in range(3):\n    ")
    a = sample(
        out, f"--start=FILE:{tmp_path / 'p.txt'}", "--temperature=0", "--max_new_tokens=10"
    ).stdout
    assert (
        a.startswith("for i in range(3):\n    ")
        and a
        == sample(
            out, "--start=for i in range(3):\n    ", "--temperature=0", "--max_new_tokens=10"
        ).stdout
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--start=héllo ü"],
            "characters not in the dataset's vocabulary: 'é' (U+00E9), 'ü' (U+00FC)",
        ),
        (["--start=FILE:/no/such/prompt.txt"], "prompt file /no/such/prompt.txt not found"),
        (["--start=" + "x" * 65], "a prompt has 65 tokens; it needs 1 to block_size=64"),
        (["--max_new_tokens=-1"], "max_new_tokens=-1 must not be negative"),
        (["--out_dir=/no/such/dir"], "no checkpoint at /no/such/dir/ckpt.pt"),
        (["--temperature=-1"], "temperature=-1.0 must be >= 0 (0 is greedy)"),
        (["--top_p=1.5"], "top_p=1.5 must be in (0, 1]"),
        (["--top_k=0"], "top_k=0 must be >= 1"),
        (["--start="], "--start= gives start an empty value"),
        (["--stop="], "stop='' would end every sample at once"),
        (["--init_from=scratch"], "init_from='scratch' must be 'resume' (out_dir/ckpt.pt), gpt2,"),
        (
            ["--init_from=hf:{tmp}"],
            "is not a GPT-2, Starcoder2 or GPTBigCode folder saved by save_pretrained",
        ),
        (["--init_from=hf:{tmp}/none"], "no Hugging Face model folder at"),
        (["--start=LINES:{tmp}/blank.txt"], "blank.txt has no non-empty line"),
        (["--start=FILE:{tmp}/latin1.txt"], "latin1.txt is not UTF-8 text"),
        (["--start=FILE:{tmp}"], "is not a file"),
    ],
)
def test_bad_input_is_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    out = make_checkpoint(tmp_path, 2)
    (out / "config.json").write_text('{"out_dir": "x"}')  # not a Hugging Face config
    (tmp_path / "blank.txt").write_text("\n\n")
    (tmp_path / "latin1.txt").write_bytes("d\xe9f".encode("latin-1"))
    r = cli(["sample.py", f"--out_dir={out}", *[a.format(tmp=out) for a in args]])
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1
    assert message in r.stderr


def test_a_tokenizer_larger_than_the_model_is_one_line(tmp_path: Path) -> None:
    cfg = GPTConfig(block_size=16, vocab_size=len(CHARS.chars) - 1, n_layer=1, n_head=2, n_embd=16)
    save_checkpoint(tmp_path / "ckpt.pt", GPT(cfg), iter_num=0, data_meta=CHARS.meta())
    r = cli(["sample.py", f"--out_dir={tmp_path}"])
    assert r.returncode == 2 and r.stderr == (
        f"error: the tokenizer has {len(CHARS.chars)} tokens, the model only "
        f"{cfg.vocab_size}: not the dataset this checkpoint was trained on\n"
    )


@COMPILES
def test_compiling_with_no_cpp_compiler_is_one_line(tmp_path: Path) -> None:
    out = make_checkpoint(tmp_path, 2)
    # inductor's own patch: monkeypatch's undo deletes the key from inductor's config, breaking
    # later compiles
    with torch._inductor.config.patch({"cpp.cxx": (None, "no-such-compiler")}):
        r = cli(
            ["sample.py", f"--out_dir={out}", "--compile=True", "--max_new_tokens=5"],
            env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")},
        )  # no package to load: one to compile
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "error: compiling the decode step (compile=True) needs a C++ compiler: "
        "install g++ (or set CXX), or decode without compile"
    ]


class RunsCode:
    """Unpickled, it would call os.system (weights_only=True refuses it before)."""

    def __reduce__(self) -> tuple:
        return os.system, ("true",)


def test_corrupt_and_code_carrying_checkpoints_are_refused(tmp_path: Path) -> None:
    out = make_checkpoint(tmp_path / "a", 2)
    data = (out / "ckpt.pt").read_bytes()
    for broken in (
        data[: len(data) // 2],
        b"",
        torch.randint(0, 256, (5000,), dtype=torch.uint8).numpy().tobytes(),
    ):
        (out / "ckpt.pt").write_bytes(broken)  # truncated, empty, random bytes
        r = cli(["sample.py", f"--out_dir={out}"])
        assert (
            r.returncode == 2
            and "is corrupt or truncated" in r.stderr
            and "Traceback" not in r.stderr
        )
    with zipfile.ZipFile(
        io.BytesIO(data)
    ) as z:  # a whole archive whose pickle has bytes overwritten
        pkl = next(i for i in z.infolist() if i.filename.endswith("data.pkl"))
    start = (
        pkl.header_offset + 30 + len(pkl.filename) + len(pkl.extra) + 20
    )  # 30: the zip's local header
    (out / "ckpt.pt").write_bytes(data[:start] + b"\x99" * 40 + data[start + 40 :])
    r = cli(
        ["sample.py", f"--out_dir={out}"]
    )  # torch's reason (its words vary by release), not its advice
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1, (
        r.stderr
    )
    assert r.stderr.startswith(
        f"error: checkpoint {out / 'ckpt.pt'} is corrupt ("
    ) and r.stderr.endswith(")\n")
    assert "weights_only" not in r.stderr
    (out / "ckpt.pt").unlink()
    (out / "ckpt.pt").mkdir()
    r = cli(["sample.py", f"--out_dir={out}"])
    assert (
        r.returncode == 2
        and r.stderr == f"error: {out / 'ckpt.pt'} is a folder, not a checkpoint file\n"
    )
    evil = tmp_path / "b"
    evil.mkdir()
    torch.save(
        {"model": {}, "model_config": {}, "payload": Path("x")}, evil / "ckpt.pt"
    )  # a pickled class
    r = cli(["sample.py", f"--out_dir={evil}"])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"error: refusing to load {evil / 'ckpt.pt'}: it holds pathlib")
    torch.save(
        {"model": {}, "model_config": {}, "payload": RunsCode()}, evil / "ckpt.pt"
    )  # a blocked module's
    r = cli(["sample.py", f"--out_dir={evil}"])
    held = f"{os.system.__module__}.system"  # posix.system on Linux
    assert r.returncode == 2 and r.stderr.startswith(
        f"error: refusing to load {evil / 'ckpt.pt'}: it holds {held}"
    )


def test_summary_line_reports_speed_cache_and_attention_kind(tmp_path: Path) -> None:
    out = make_checkpoint(tmp_path, 1)
    r = sample(out, "--start=a", "--max_new_tokens=20", "--num_samples=2")
    assert (
        "40 tokens in" in r.stderr
        and "prefill" in r.stderr
        and "MQA (n_head=4, n_kv_head=1)" in r.stderr
    )
    # by hand: K and V, 2 layers, 2 rows, 1 K/V head, 20 positions (1 prompt + 20 new - 1), head_dim
    # 32 / 4, fp32
    kv = 2 * 2 * 2 * 1 * 20 * (32 // 4) * 4
    assert f"KV cache {kv:,} bytes" in r.stderr


def test_top_k_with_top_p_draws_only_the_allowed_characters(tmp_path: Path) -> None:
    """300 one-character samples of one prompt: every character drawn is among those top-k then
    top-p allow, as computed here from the model's own probabilities, and the likely ones are all
    drawn."""
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(block_size=64, vocab_size=len(CHARS.chars), n_layer=2, n_head=4, n_embd=32)
    )
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # peakier than the near-uniform random model
        logits = model(torch.tensor([CHARS.encode("def f")]))[0][0, -1]
    save_checkpoint(tmp_path / "ckpt.pt", model, iter_num=0, data_meta=CHARS.meta())
    probs = {CHARS.chars[i]: p for i, p in allowed(logits / 0.8, top_k=20, top_p=0.7).items()}
    r = sample(
        tmp_path,
        "--start=def f",
        "--num_samples=300",
        "--max_new_tokens=1",
        "--temperature=0.8",
        "--top_k=20",
        "--top_p=0.7",
        "--seed=3",
    )
    record = (
        len("def f") + 1 + len("\n---------------\n")
    )  # each row: prompt, its one new character, a separator
    drawn = [r.stdout[i * record + len("def f")] for i in range(300)]
    assert len(r.stdout) == 300 * record and set(drawn) <= probs.keys()
    assert {c for c, p in probs.items() if p > 0.03} <= set(drawn) and len(set(drawn)) > 1


def test_a_single_sample_streams_its_text_and_keeps_none(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A single sample is printed piece by piece while decoding (a stop string included), and
    neither its text nor a time per step is kept: memory does not grow with max_new_tokens."""
    import sample as sample_script

    make_checkpoint(tmp_path, 2)
    model = model_from_checkpoint(load_checkpoint(tmp_path / "ckpt.pt")).eval()
    cfg = sample_script.SampleConfig(
        max_new_tokens=80, temperature=1.0, top_k=None, stop="e", seed=5
    )
    texts, n_tokens, times = sample_script.decode(
        model, CHARS, torch.tensor([CHARS.encode("import ")]), None, cfg
    )
    streamed = capsys.readouterr().out
    assert (
        texts == [""]
        and 0 < n_tokens == len(streamed)
        and streamed.endswith("e")
        and "e" not in streamed[:-1]
    )
    # a token a step: the first, the longest after it (where a compiled step is ready), the last;
    # never one a step
    assert len(times) == min(n_tokens, 3) and times[0][1] == 1 and times[-1][1] == n_tokens


def test_bpe_sample_stops_at_the_end_of_text_token(tmp_path: Path) -> None:
    """A GPT-2-BPE checkpoint (a byte-level BPE file stands in for GPT-2's download) whose
    end-of-text token is made the greedy choice at a known step: the model's embedding rows of eot
    and of a token t it would emit there are swapped, so it computes what it did before with the two
    exchanged, and sample.py stops where t came first."""
    bpe = tmp_path / "tiny.tiktoken"
    bpe.write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
    eot = 256  # tiktoken's id for the special token after 256 byte tokens
    prompt = list(b"To be")
    for seed in range(
        20
    ):  # a model whose greedy text has a new token (t) at some step >= 2 before any eot
        torch.manual_seed(seed)
        model = GPT(GPTConfig(block_size=64, vocab_size=257, n_layer=2, n_head=4, n_embd=32))
        sharpened(model)  # at initialisation greedy decoding repeats one token
        free = generate(model, torch.tensor([prompt]), 20, temperature=0)[0, len(prompt) :].tolist()
        stop = next(
            (
                i
                for i, x in enumerate(free)
                if i >= 2 and x not in prompt + free[:i] and eot not in free[:i]
            ),
            None,
        )
        if stop is not None:
            break
    t = free[stop]
    with torch.no_grad():
        w = model.transformer.wte.weight  # tied with lm_head
        w[[t, eot]] = w[[eot, t]].clone()
    out = tmp_path / "bpe"
    out.mkdir()
    save_checkpoint(
        out / "ckpt.pt", model, iter_num=0, data_meta={"tokenizer": "gpt2", "vocab_size": 257}
    )
    env = {"GPT2_BPE_FILE": str(bpe)}
    r = run(
        [
            "sample.py",
            f"--out_dir={out}",
            "--start=To be",
            "--temperature=0",
            "--max_new_tokens=20",
        ],
        env=env,
    )
    assert f"{stop} tokens in" in r.stderr and r.stdout.startswith("To be")
    assert (
        r.stdout.encode()[len(prompt) :]
        == bytes(free[:stop]).decode(errors="replace").encode() + b"\n"
    )
