import contextlib
import functools
import getpass
import io
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import budgets
from model import GPT, GPTConfig
from smallgpt import delta_rule_kernel

VARIANTS = {"MHA": 4, "GQA": 2, "MQA": 1}  # n_kv_head for n_head=4
# The GPT-2-shaped model (as bench.py --mode=hf builds it) that the tests compiling a decode step
# use where they can (sample.py --compile, bench.py --mode=hf and --mode=int8 at batch 1;
# test_generate's MHA case at batch 2): inductor's cache folder keeps one package per exported step,
# so the suite compiles each once (docs/testing.md).
DECODE = dict(n_layer=2, n_head=4, n_embd=32, block_size=64, vocab_size=96, bias=True, gelu="tanh")
# The tests that compile a decode step (the suite's largest cost) run in two pytest-xdist groups,
# each one test after another in one worker (scripts/test.sh runs two), so that both workers compile
# from the start: in a group, the first test to need a step compiles it, the later ones load it from
# inductor's cache. COMPILES: the batch-1 DECODE step (bench.py --mode=hf compiles it first,
# sample.py --compile loads it), the int8 ones (DECODE's, and the decode matrix's MLA with local
# layers), GQA's without the template. COMPILES_2: the batch-2 MHA and MLA steps, the bf16 one, the
# two models in turns (DECODE with 2 heads), then (last in test_generate.py, a minute or more after
# the other group compiled it) the tests that load the batch-1 DECODE step; were it not there yet,
# they would compile it.
COMPILES = pytest.mark.xdist_group("compiled_steps")
COMPILES_2 = pytest.mark.xdist_group("compiled_steps_2")


def template_where_it_can(choices: list) -> list:
    """Of inductor's choices for a product, the GEMM template's (named cpp_...) where it has any,
    else all (ATen's bmm of MLA's absorbed attention, say)."""
    template = [c for c in choices if c.name.startswith("cpp_")]
    return template or choices


# The compiled steps the suite makes put every product that inductor's GEMM template can take
# through it, without timing it against ATen's product first (autotuning: a third of each
# compile, g++ building and timing each candidate). The program is the one autotuning makes where
# the template wins, as at these sizes on AVX-512; which products take it is fixed, not timed (the
# tests that need ATen's products in a step ask for them: TEMPLATE_MAX_BYTES). So that a user's
# compiled steps are never these, the suite keeps inductor's cache in a folder of its own (shared
# by every checkout, unless TORCHINDUCTOR_CACHE_DIR names one). docs/testing.md "Compiled decode
# steps".
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR",
    str(Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}_smallgpt_tests"),
)


def pytest_configure(config: pytest.Config) -> None:
    """The delta-rule CPU kernel built once before the tests (cached outside the repo: a line while
    it builds, nothing after), in the one process that starts the others (pytest-xdist's
    controller: a worker has `workerinput`), so that no test pays for it and two workers never
    build it at once; a machine that cannot build it says so and tests the torch path
    (smallgpt/delta_rule_kernel.py)."""
    if not hasattr(config, "workerinput"):
        delta_rule_kernel.available()


@functools.cache
def register_template_choice() -> None:
    """template_where_it_can registered with inductor, once a process."""
    from torch._inductor import select_algorithm

    select_algorithm.add_preprocessing_fn(template_where_it_can)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """template_where_it_can registered with inductor before the first test that compiles a step
    (those in the two groups above; any test after inductor was first imported): importing
    inductor's autotuning takes 1-2 s, which a run of tests that compile nothing and build no
    optimizer does not pay (torch's optimizers import torch._dynamo, and so inductor, in their
    constructor: most workers pay it once, at the test after their first training)."""
    if item.get_closest_marker("xdist_group") is not None or "torch._inductor" in sys.modules:
        register_template_choice()


# A shell starts a background job with SIGINT ignored, and a Python started so keeps it ignored
# (no KeyboardInterrupt): the tests that press Ctrl-C in a script they start would see it do
# nothing. The handler a foreground Python has, so the scripts they start (exec resets a handler to
# the default) get it too.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


BUDGET_FACTOR = budgets.scale()
BUDGET_STRICT = budgets.strict()
OVERRUN = "budget_overrun"  # the user_properties key that carries an overrun to the summary


def pytest_itemcollected(item: pytest.Item) -> None:
    """A test with a budget of its own (tests/budgets.py) is slow: `-m "not slow"` leaves it out."""
    if budgets.listed(item.nodeid):
        item.add_marker(pytest.mark.slow)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A test whose setup or call passed but took longer than its budget (tests/budgets.py) is
    reported in the summary (its report carries the line: pytest-xdist sends user_properties to
    the controller), or fails saying so in strict mode."""
    report = yield
    if call.when in ("setup", "call") and report.passed:
        problem = budgets.overrun(item.nodeid, call.when, call.duration, BUDGET_FACTOR)
        if problem is not None and BUDGET_STRICT:
            report.outcome = "failed"
            report.longrepr = problem
        elif problem is not None:
            report.user_properties.append((OVERRUN, problem))
    return report


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The tests over their time budgets, a line each, after the run (in the controller under
    pytest-xdist): reported, not failed, outside strict mode."""
    lines = [
        value
        for reports in terminalreporter.stats.values()
        for report in reports
        for key, value in getattr(report, "user_properties", ())
        if key == OVERRUN
    ]
    if not lines:
        return
    terminalreporter.section("time budgets")
    for line in lines:
        terminalreporter.write_line(line)
    terminalreporter.write_line(
        f"{len(lines)} over their time budgets (reported, not failed; "
        "SMALLGPT_TEST_BUDGET_STRICT=1 fails them: tests/budgets.py)"
    )


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests with the largest budgets first: pytest-xdist hands out the groups above first (the
    largest first), then the other tests in this order, so the longest start early rather than
    leave one worker alone at the end. And the groups themselves: --dist loadgroup tells a
    group by a suffix on its tests' node ids, which pytest-xdist 3.8 sets on an attribute that
    pytest 9.2 no longer reads (its node ids are structured), so that each test went to any worker
    (pytest-xdist issue 1386): the suffix is set on the structured id here."""
    items.sort(key=lambda item: -budgets.budget(item.nodeid))
    if getattr(config.option, "loadgroup", False):  # a pytest-xdist worker, under --dist loadgroup
        for item in items:
            group = item.get_closest_marker("xdist_group")
            if group and "@" not in item.nodeid and hasattr(item, "_id"):
                item._id = type(item._id).parse(f"{item.nodeid}@{group.args[0]}")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1337)


def sharpened(m: torch.nn.Module) -> torch.nn.Module:
    """The model with its matrices scaled up 3x: at initialisation a random model's greedy tokens
    hardly depend on the context (it mostly repeats itself), so a wrong window would go
    unnoticed."""
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    return m


# Qwen3.5's block (transformers' Qwen3_5ForCausalLM holds a model of these keys)
QWEN = dict(norm="rmsnorm", mlp="swiglu", bias=False, pos_encoding="rope")


def exported_logits(m: GPT, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """m's logits and its Qwen3_5ForCausalLM's (smallgpt/hf.py) on idx."""
    from smallgpt.hf import to_hf

    with torch.no_grad():
        return m(idx, idx)[0], to_hf(m)(idx).logits


def lively(m: torch.nn.Module) -> torch.nn.Module:
    """The model with sharp attention (queries and keys scaled 20x) and the blocks' other matrices
    5x, embeddings as they are: its greedy tokens depend on the context, so that a window off by
    one, or a stale or hidden cache slot, changes them (sharpened's 3x of everything missed such
    bugs in most tiny models)."""
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 2 and not name.startswith(("transformer.wte", "transformer.wpe")):
                p.mul_(20.0 if name.endswith(("c_q.weight", "c_k.weight")) else 5.0)
    return m


def distinct(tokens: torch.Tensor | list | str) -> int:
    """How many different tokens (or characters) greedy continuations hold: 1 or 2 for a degenerate
    one."""
    return len(
        set(tokens if isinstance(tokens, str) else torch.as_tensor(tokens).flatten().tolist())
    )


def allowed(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> dict[int, float]:
    """The candidates of top-k then top-p sampling and their probabilities, computed the slow way by
    hand."""
    order = sorted(range(logits.numel()), key=lambda i: -float(logits[i]))
    keep = order[:top_k] if top_k else order
    probs = torch.softmax(logits[keep], dim=-1).tolist()
    chosen, mass = {}, 0.0
    for i, p in zip(keep, probs, strict=True):
        if top_p is not None and mass >= top_p:
            break
        chosen[i] = p
        mass += p
    return {i: p / mass for i, p in chosen.items()}


def assert_same_greedy_tokens(
    model: torch.nn.Module, hf: torch.nn.Module, prompt: torch.Tensor, n: int = 20
) -> None:
    """Our greedy continuation of prompt equals transformers' (generate), and is not one token
    repeated."""
    from smallgpt.generation import generate

    with torch.no_grad():
        mine = generate(model, prompt, n, temperature=0)
        theirs = hf.generate(
            prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
        )
    assert len(set(mine[:, prompt.size(1) :].flatten().tolist())) > 5
    assert torch.equal(theirs, mine)


def first_and_last_loss(m: torch.nn.Module, steps: int) -> tuple[float, float]:
    """The training forward compiles without graph breaks; then AdamW fits one batch of 2 x 32 for
    steps steps."""
    idx = torch.randint(0, 61, (2, 32))
    explanation = torch._dynamo.explain(m)(idx, idx)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        _, loss = m(idx, idx)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses[0], losses[-1]


def config_error(**overrides: object) -> str:
    """The one line GPTConfig's ValueError says of a 2 x 32 model with overrides."""
    with pytest.raises(ValueError) as err:
        GPTConfig(n_layer=2, n_head=4, n_embd=32, **overrides)
    assert "\n" not in str(err.value)
    return str(err.value)


def cached_chunks_match(m: torch.nn.Module, atol: float = 1e-5) -> torch.Tensor:
    """Chunks of 9, 1 and 7 tokens and then one token at a time through one cache give the last
    logits of the prefix recomputed whole, for 3 rows of 32 random tokens; returns the tokens."""
    idx = torch.randint(0, 61, (3, 32))
    cache = m.make_kv_cache(3, 32)
    for a, b in [(0, 9), (9, 10), (10, 17), *((t, t + 1) for t in range(17, 32))]:
        logits, _ = m(idx[:, a:b], kv_cache=cache)
        torch.testing.assert_close(logits[:, -1], m(idx[:, :b])[0][:, -1], rtol=0, atol=atol)
    assert cache.pos == 32
    return idx


def padded_steps_match(m: torch.nn.Module, atol: float = 1e-5) -> None:
    """A left-padded batch of prompts of 3, 11, 1 and 7 tokens, prefilled, then 6 one-token steps:
    each row's logits are its prompt's alone, recomputed whole."""
    from smallgpt.generation import left_pad

    prompts = [torch.randint(0, 61, (n,)).tolist() for n in (3, 11, 1, 7)]
    idx, pad = left_pad(prompts, pad_token=5)
    cache = m.make_kv_cache(len(prompts), 24)
    m(idx, kv_cache=cache, pad=pad)
    extra = torch.randint(0, 61, (len(prompts), 6))
    for t in range(6):
        cached, _ = m(extra[:, t : t + 1], kv_cache=cache, pad=pad)
        for row, p in enumerate(prompts):
            alone = torch.tensor([p + extra[row, : t + 1].tolist()])
            torch.testing.assert_close(cached[row, -1], m(alone)[0][0, -1], rtol=0, atol=atol)


def static_steps_match(
    m: torch.nn.Module, steps: range, max_len: int
) -> tuple[object, object, object]:
    """static_step.decode_static, over the whole cache under a mask (what CUDA graphs replay) and
    over its filled length (the compiled CPU step's form), gives GPT.forward's one-token logits at
    each of steps, after a prefill of steps.start tokens; returns the three caches (forward's, and
    the two static ones) to compare."""
    from smallgpt.static_step import decode_static

    idx = torch.randint(0, 61, (2, steps.stop))
    with torch.inference_mode():
        ref, static, filled = (m.make_kv_cache(2, max_len) for _ in range(3))
        for cache in (ref, static, filled):
            m(idx[:, : steps.start], kv_cache=cache)
        for t in steps:
            want, _ = m(idx[:, t : t + 1], kv_cache=ref)
            got = decode_static(m, idx[:, t : t + 1], torch.tensor([t]), static)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            got = decode_static(m, idx[:, t : t + 1], torch.tensor([t]), filled, length=t + 1)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    return ref, static, filled


def tiny_model(
    n_kv_head: int | None = None, pos_encoding: str = "learned", **overrides: object
) -> GPT:
    """A 2-layer, 32-wide model in eval mode, fp32 on CPU."""
    cfg = (
        dict(
            block_size=32,
            vocab_size=61,
            n_layer=2,
            n_head=4,
            n_kv_head=n_kv_head,
            n_embd=32,
            dropout=0.0,
            bias=True,
            pos_encoding=pos_encoding,
        )
        | overrides
    )
    return GPT(GPTConfig(**cfg)).eval()


ROOT = Path(__file__).resolve().parent.parent
# torchrun with 2 processes on this machine (python -m torch.distributed.run: the venv's own)
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
# The seed of the tests that bound DDP's and FSDP's drift from one process (float summation order,
# carried by AdamW's normalised steps over 20 iterations). That drift depends on the initial
# weights: measured for test_ddp's run under the per-name initialisation (GPT.init_weights), largest
# weight difference 1.7e-7 at seed 1338, 1.2e-7 at 1339, but 2e-4 at 1337 (the weights agree to 1e-7
# at iteration 10, then move apart), past the tests' 1e-4 bound.
SEED = 1339
TINY_TRAIN = [
    "--n_layer=2",
    "--n_head=4",
    "--n_embd=32",
    "--block_size=32",
    "--batch_size=8",
    "--eval_iters=4",
    "--log_interval=10",
    "--learning_rate=3e-3",
    "--warmup_iters=5",
    "--device=cpu",
    "--dtype=float32",
]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def cli(args: list[str], env: dict | None = None, cwd: Path | None = None) -> Result:
    """`python SCRIPT ARGS...` from the repo root (or from cwd, SCRIPT still the repo's), run in
    this process as __main__ (runpy): the script's own command line, errors and exit status,
    without the 2-3 s a fresh interpreter spends importing torch. Tests that need a process of their
    own (signals, torchrun, wandb, variables read at import) use subprocess instead."""
    script, *rest = args
    out, err = (io.TextIOWrapper(io.BytesIO(), encoding="utf-8") for _ in range(2))
    saved = dict(os.environ), sys.argv, os.getcwd()
    os.environ.update(env or {})
    sys.argv = [script, *rest]
    os.chdir(cwd or ROOT)
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(str(ROOT / script), run_name="__main__")
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
            except (
                Exception
            ):  # what the interpreter would do: the traceback on stderr, exit status 1
                traceback.print_exc()
                code = 1
    finally:
        os.environ.clear()
        os.environ.update(saved[0])
        sys.argv = saved[1]
        os.chdir(saved[2])
    out.flush()
    err.flush()
    return Result(code, out.buffer.getvalue().decode(), err.buffer.getvalue().decode())


def run(
    args: list[str], env: dict | None = None, timeout: float = 300, fresh: bool = False
) -> Result | subprocess.CompletedProcess:
    """Run a python command in the repo root and fail with its output unless it succeeds: a script
    in this process (cli), or in a fresh interpreter with fresh=True and for `-m module` /
    `-c code`."""
    if fresh or args[0].startswith("-"):
        r = subprocess.run(
            [sys.executable, *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **(env or {})},
        )
    else:
        r = cli(args, env)
    assert r.returncode == 0, (
        f"{args} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    )
    return r


@pytest.fixture(scope="session")
def pycode_small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real pycode_char prepare script, cut to its first 300k characters."""
    out = tmp_path_factory.mktemp("pycode_small")
    run(["data/pycode_char/prepare.py", f"--out_dir={out}", "--max_chars=300000"])
    return out


def read_log(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "log.jsonl").read_text().splitlines()]


def worker_ranks(parent: int) -> dict[int, int]:
    """{RANK: pid} of the processes whose parent is `parent` (torchrun's workers), from /proc."""
    ranks = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) != parent:
                continue
            env = dict(
                v.split("=", 1) for v in (proc / "environ").read_text().split("\0") if "=" in v
            )
        except (OSError, ValueError):
            continue
        ranks[int(env["RANK"])] = int(proc.name)
    return ranks


# --- distributed fixtures ---


def log_so_far(out: Path) -> list[dict]:
    """out's log.jsonl records so far: none while there is no log or its last line is half
    written."""
    try:
        return read_log(out)
    except (FileNotFoundError, ValueError):
        return []


def sigterm_rank_1(data: Path, out: Path, *extra: str) -> tuple[str, str, int]:
    """A 2-process train.py run (torchrun, a thread each) sent SIGTERM to rank 1 alone (a
    pre-emption notice reaching one worker) once it has logged an iteration: its stdout, stderr and
    exit status. torchrun and its workers are killed if they are still there after."""
    p = subprocess.Popen(
        [
            sys.executable,
            *TORCHRUN,
            "train.py",
            f"--dataset={data}",
            f"--out_dir={out}",
            *TINY_TRAIN,
            "--log_interval=1",
            "--max_iters=100000",
            "--eval_interval=100000",
            "--gradient_accumulation_steps=2",
            *extra,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
        start_new_session=True,
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not any(r["event"] == "train" for r in log_so_far(out)):
            time.sleep(0.05)
        os.kill(worker_ranks(p.pid)[1], signal.SIGTERM)  # both stop at a log step
        stdout, stderr = p.communicate(timeout=120)
    finally:  # each in a session of its own
        if p.poll() is None:
            for pid in [*worker_ranks(p.pid).values(), p.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
    return stdout, stderr, p.returncode


@contextlib.contextmanager
def one_thread() -> Generator[None, None, None]:
    """torch on 1 thread in this process, as each torchrun worker runs (OMP_NUM_THREADS=1): a
    train.py run in this process (cli) then gives a fresh `OMP_NUM_THREADS=1 python train.py`'s
    numbers bit for bit (the thread count changes float summation order, and fast_paths' linear
    splits its weight over 2 threads or more), without the 2-3 s of a fresh interpreter."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# --- shared runs ---

# MFU's peak, given to the train.py runs of tests that do not read MFU: such a run does not probe
# the CPU's (0.35 s of matmuls a run, repeated by every run)
NO_PROBE = "--peak_flops=1e12"
