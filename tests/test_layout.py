"""The house rules a newcomer relies on: no import cycle between the top-level modules, no script
importing another script for helpers, nothing done at import time; and errors: a user's mistake is
one line, a bug keeps its traceback.
"""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import NO_PROBE, ROOT, cli

# The root's modules (model, train, ...) and the package's (smallgpt.checkpoint, ...), by their
# import names
MODULES = sorted(
    [p.stem for p in ROOT.glob("*.py")]
    + [f"smallgpt.{p.stem}" for p in (ROOT / "smallgpt").glob("*.py") if p.stem != "__init__"]
)
SCRIPTS = {"train", "sample", "bench", "compare", "export", "eval"}


def source_of(module: str) -> Path:
    return ROOT / (module.replace(".", "/") + ".py")


def project_imports(module: str) -> dict[str, set[str]]:
    """{project module: names imported from it} for one of MODULES, anywhere in its code:
    `from smallgpt import x` is an import of smallgpt.x."""
    deps: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(source_of(module).read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                deps.setdefault(alias.name, set()).add("<module>")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if sub in MODULES:
                    deps.setdefault(sub, set()).add("<module>")
                else:
                    deps.setdefault(node.module, set()).add(alias.name)
    return {m: names for m, names in deps.items() if m in MODULES and m != module}


def test_the_import_graph_has_no_cycle() -> None:
    graph = {m: set(project_imports(m)) for m in MODULES}
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        if m in path:
            pytest.fail("import cycle: " + " -> ".join(path[path.index(m) :] + [m]))
        if m not in done:
            for dep in sorted(graph[m]):
                visit(dep, path + [m])
            done.add(m)

    for m in MODULES:
        visit(m, [])
    # the model is a leaf: the cache (kv_cache.py) needs nothing of ours, what a kind declares
    # (layer_kind.py) only the cache, the kinds' files those and the fast paths (gated_deltanet.py
    # also the delta rule, its arithmetic, which imports nothing of ours, the compiled kernels of
    # the rule and the convolution, and attention's norm; kimi_delta.py those and Gated
    # DeltaNet's convolution); model.py the kinds' files; so the engine imports the model, never
    # the reverse
    below = {"smallgpt.fast_paths", "kv_cache", "layer_kind"}
    kinds = {"attention", "gated_deltanet", "kimi_delta"}
    # the config module holds the kinds' table: it imports them, and the model imports it
    assert graph["model_config"] <= {*below, *kinds}
    assert "model" in done and graph["model"] <= {*below, *kinds, "model_config"}
    assert graph["kv_cache"] == set() and graph["layer_kind"] == {"kv_cache"}
    assert graph["attention"] <= below
    rule = {"smallgpt.delta_rule", "smallgpt.delta_rule_kernel"}
    assert graph["gated_deltanet"] <= {*below, *rule, "attention"}
    assert graph["kimi_delta"] <= {*below, *rule, "attention", "gated_deltanet"}
    # the rule's arithmetic, and its compiled CPU kernel, which imports nothing of ours either
    assert graph["smallgpt.delta_rule"] <= {"smallgpt.delta_rule_kernel"}
    assert graph["smallgpt.delta_rule_kernel"] == set()


# The pattern keys' readers besides the config module (model_config.py: GPTConfig.layers, the
# one place they are tiled, and pattern_keys, their inverse) and the variant grammar: a key's own
# checks (attention's NoPE one, compare.py's refusal of the base run's windows), the keys a
# conversion changes, the conversion building its target from the letters it is given, and
# bench configs (scripts/cuda_steps.py). Everything else asks config.layers[i].
PATTERN_KEYS = {"layer_pattern", "window_pattern", "rope_pattern"}
PATTERN_READERS = {
    "attention": 2,
    "compare": 2,
    "smallgpt.convert": 2,
    "smallgpt.hybridize": 1,
}


def test_only_the_config_module_reads_the_pattern_keys() -> None:
    """Lines of code (an attribute, a keyword or a string equal to a key; comments and docstrings
    aside) naming layer_pattern, window_pattern or rope_pattern, in each module but the config
    module and the variant grammar: at most the counts above."""
    readers = {}
    for module in MODULES:
        if module in ("model_config", "smallgpt.variant"):
            continue
        lines = set()
        for node in ast.walk(ast.parse(source_of(module).read_text())):
            if isinstance(node, ast.Attribute) and node.attr in PATTERN_KEYS:
                lines.add(node.lineno)
            elif isinstance(node, ast.keyword) and node.arg in PATTERN_KEYS:
                lines.add(node.value.lineno)
            elif isinstance(node, ast.Constant) and node.value in PATTERN_KEYS:
                lines.add(node.lineno)
        if lines:
            readers[module] = len(lines)
    over = {m: n for m, n in readers.items() if n > PATTERN_READERS.get(m, 0)}
    assert not over, f"modules reading a pattern key (ask config.layers instead): {over}"


def test_the_import_graph_in_the_docs_is_the_codes() -> None:
    """docs/architecture.md lists each module's project imports (as house.py prints them): the list
    is the code's."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text[text.index("## The import graph") :].split("```")[1]
    listed: dict[str, set[str]] = {}
    module = ""
    for line in block.strip().splitlines():
        if " -> " in line:  # 'x.py -> a, b, c' (long lists go on on indented lines)
            module, line = line.split(" -> ")
            module = module.removesuffix(".py")
            listed[module] = set()
        listed[module] |= {d.strip() for d in line.split(",") if d.strip() and d.strip() != "-"}
    assert listed == {m: set(project_imports(m)) for m in MODULES}


def test_no_script_imports_another_scripts_helpers() -> None:
    """A script may import another's config dataclass (as nanoGPT keeps it there) and the training
    step that bench.py times; helpers live in the modules below the scripts."""
    for script in sorted(SCRIPTS & set(MODULES)):
        for dep, names in project_imports(script).items():
            helpers = {n for n in names if not n.endswith("Config") and n != "train_step"}
            assert dep not in SCRIPTS or not helpers, (
                f"{script}.py imports {sorted(helpers)} from {dep}.py"
            )


FRESH_IMPORTS = """
import ast, importlib, importlib.util, os, sys, traceback
import torch.distributed as dist
# Loaded once: the other packages' modules that the project's modules import at their top level
# (torch._inductor's alone takes ~1 s); each project module is then imported first in a fork.
ours = sys.argv[1:]
for module in ours:
    for node in ast.parse(open(importlib.util.find_spec(module).origin).read()).body:
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else (
            [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
        if names and all(
            name.split(".")[0] not in {m.split(".")[0] for m in ours} for name in names
        ):
            exec(ast.unparse(node), {})
forks = {}
for module in ours:  # all forks at once: the cores share the imports
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(module)
            assert not dist.is_initialized(), "a process group was started"
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    forks[module] = pid
failed = [module for module, pid in forks.items() if os.waitpid(pid, 0)[1]]
sys.exit(f"failed: {failed}" if failed else 0)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks one fresh import per module")
def test_every_module_imports_first_and_alone_and_does_nothing(tmp_path: Path) -> None:
    """Each module imported before any other project module (an import cycle fails there), in a
    clean process: it prints and writes nothing and starts no process group."""
    r = subprocess.run(
        [sys.executable, "-c", FRESH_IMPORTS, *MODULES],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 0 and r.stdout == "" and r.stderr == "", r.stdout + r.stderr
    assert list(tmp_path.iterdir()) == []


# What a script must not import before it needs it: torch's compiler (1.2 s for dynamo alone, and
# 0.7-0.9 s more at exit), and the libraries a hub or a logger brings (docs/performance-cpu.md
# "Start-up")
HEAVY = ["torch._dynamo", "torch._inductor", "transformers", "datasets", "wandb", "matplotlib"]


def test_the_scripts_start_without_the_compiler_or_the_hub_libraries() -> None:
    """Importing every script (what `python train.py --help` pays before it does anything) loads
    none of HEAVY: a decorator of torch.compiler's at a module's top imported torch._dynamo into
    every script and every test that starts one."""
    code = (
        f"import sys, {', '.join(sorted(SCRIPTS))}\n"
        f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and r.stdout.strip() == "", r.stdout + r.stderr


RUN_WITH_A_BUG = """
import sys, train, configurator
def broken(*args, **kwargs):
    raise RuntimeError("an internal bug")
# a genuine failure inside the training loop, as a bug or CUDA out-of-memory would be
train.evaluate = broken
configurator.run_cli(train.main, train.TrainConfig, sys.argv[1:])
"""


def test_a_bug_keeps_its_traceback_and_a_user_error_is_one_line(
    pycode_small: Path, tmp_path: Path
) -> None:
    args = [
        f"--dataset={pycode_small}",
        f"--out_dir={tmp_path / 'out'}",
        "--n_layer=1",
        "--n_embd=32",
        "--n_head=2",
        "--block_size=16",
        "--batch_size=2",
        "--max_iters=1",
        "--device=cpu",
        NO_PROBE,
    ]
    r = subprocess.run(
        [sys.executable, "-c", RUN_WITH_A_BUG, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and "Traceback (most recent call last)" in r.stderr, r.stderr
    assert "RuntimeError: an internal bug" in r.stderr and "error: an internal bug" not in r.stderr
    r = cli(["train.py", *args, "--batch_size=0"])
    assert (
        r.returncode == 2 and r.stderr == "error: invalid config: batch_size=0 must be positive\n"
    ), r.stderr


def test_pip_install_declares_the_requirements_and_installs_only_imported_modules() -> None:
    """`pip install -e .` gives a working environment: its dependencies are requirements.txt's
    (the metadata setuptools builds from pyproject.toml); and of the root's modules it puts at the
    top level of an environment only those that the package, data/*/prepare.py and scripts/ import
    (a script runs by its path: `train`, `eval`, ... are not installed, docs/architecture.md)."""
    from packaging.requirements import Requirement
    from setuptools.config.pyprojecttoml import read_configuration

    config = read_configuration(ROOT / "pyproject.toml")

    def names(lines: list[str]) -> set[str]:
        kept = [line.split("#")[0].strip() for line in lines]
        return {Requirement(line).name for line in kept if line}

    listed = (ROOT / "requirements.txt").read_text().splitlines()
    assert names(config["project"]["dependencies"]) == names(listed) and "torch" in names(listed)
    root_modules = {p.stem for p in ROOT.glob("*.py")}
    importers = [*(ROOT / "smallgpt").glob("*.py"), *ROOT.glob("data/*/*.py")]

    def imports(path: Path) -> set[str]:
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module)
        return found

    imported = set()
    for path in [*importers, *ROOT.glob("scripts/*.py")]:
        imported |= imports(path)
    # and what those root modules import in turn (model.py imports the kinds' files)
    while new := {
        name
        for module in imported & root_modules
        for name in imports(ROOT / f"{module}.py")
        if name not in imported
    }:
        imported |= new
    installed = set(config["tool"]["setuptools"]["py-modules"])
    assert installed == imported & root_modules
    assert not installed & SCRIPTS


def code_lines(path: Path) -> list[str]:
    """path's lines of code, its comments and docstrings left out."""
    import io
    import tokenize

    text = path.read_text()
    # the docstrings: strings standing alone as statements
    docstrings = {
        node.value.lineno
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    lines: dict[int, list[str]] = {}
    skipped = (tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE, tokenize.NL)
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        docstring = token.type == tokenize.STRING and token.start[0] in docstrings
        if token.type in skipped or docstring:
            continue
        for n in range(token.start[0], token.end[0] + 1):
            lines.setdefault(n, []).append(token.string)
    return [" ".join(parts) for _, parts in sorted(lines.items())]


def test_no_code_outside_a_kinds_file_names_it() -> None:
    """One layer kind, one place (issue 67): a kind's class, and its letter where it is no letter of
    window_pattern (whose S and L are nanochat's config letters), appear in no code but its own
    file's and its row in model_config.LAYER_KINDS (its import and the row; model.py re-exports
    it)."""
    import inspect
    import re

    from model import LAYER_KINDS

    files = [*ROOT.glob("*.py"), *ROOT.glob("smallgpt/*.py"), *ROOT.glob("scripts/*.py")]
    code = {path: code_lines(path) for path in sorted(files)}  # each file read once
    for letter, kind in LAYER_KINDS.items():
        own = Path(inspect.getfile(kind)).name
        names = [rf"\b{kind.__name__}\b"]
        if letter not in "SL":
            names.append(rf"[\"']{letter}[\"']")
        pattern = re.compile("|".join(names))
        found = [
            f"{path.name}: {line}"
            for path, lines in code.items()
            if path.name != own
            for line in lines
            if pattern.search(line)
        ]
        table = [
            f"model_config.py: from {own[:-3]} import",
            f'model_config.py: "{letter}" : {kind.__name__} ,',
        ]
        assert [line for line in found if not line.startswith(tuple(table))] == [], kind.name
