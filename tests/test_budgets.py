import ast
import os
import subprocess
import sys
import time

import pytest

import budgets
from conftest import ROOT


def test_a_budget_key_is_the_file_and_the_function() -> None:
    want = ("test_x.py", "test_y")
    assert budgets.key("tests/test_x.py::test_y") == want
    assert budgets.key("tests/test_x.py::test_y[a-b/c]@compiled_steps") == want
    assert budgets.key("tests/test_x.py::TestZ::test_y[1]") == want


def test_a_test_over_its_budget_fails_and_within_it_passes() -> None:
    nodeid = "tests/test_x.py::test_y[3]"
    allowed = budgets.budget(nodeid)
    assert allowed == budgets.DEFAULT_S and not budgets.listed(nodeid)
    assert budgets.overrun(nodeid, "call", allowed, 1.0) is None
    line = budgets.overrun(nodeid, "call", allowed + 0.1, 1.0)
    assert line is not None and "\n" not in line
    assert f"its call took {allowed + 0.1:.1f} s, over its budget of {allowed:.1f} s" in line
    assert budgets.overrun(nodeid, "call", 2 * allowed - 0.1, 2.0) is None  # a scaled budget
    assert budgets.overrun(nodeid, "call", 1e9, 0.0) is None  # the check off
    # the setup (the fixtures it builds) has a budget of its own
    assert budgets.overrun(nodeid, "setup", budgets.SETUP_S, 1.0) is None
    assert "its setup took" in budgets.overrun(nodeid, "setup", budgets.SETUP_S + 1, 1.0)
    file, tests = next(iter(budgets.BUDGETS.items()))
    name, seconds = next(iter(tests.items()))
    listed = f"tests/{file}::{name}[a]"
    assert budgets.listed(listed) and budgets.budget(listed) == seconds


def test_the_budget_scale_is_a_number_of_zero_or_more(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SMALLGPT_TEST_BUDGET", "2.5")
    assert budgets.scale() == 2.5
    for value, says in (("fast", "is not a number"), ("-1", r"must be 0 \(off\) or more")):
        monkeypatch.setenv("SMALLGPT_TEST_BUDGET", value)
        with pytest.raises(ValueError, match=says):
            budgets.scale()
    monkeypatch.delenv("SMALLGPT_TEST_BUDGET")
    assert budgets.scale() == 1.0


def test_every_budget_names_a_test_of_its_file() -> None:
    """A budget left behind by a renamed, merged or deleted test is an error, not a silent entry."""
    tests: dict[str, set[str]] = {}
    for path in (ROOT / "tests").glob("test_*.py"):
        tree = ast.parse(path.read_text())
        tests[path.name] = {
            node.name
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
        }
    stale = [
        f"{file}::{name}"
        for file, names in budgets.BUDGETS.items()
        for name in names
        if name not in tests.get(file, set())
    ]
    assert not stale, f"budgets for no test: {stale}"
    seconds = [s for names in budgets.BUDGETS.values() for s in names.values()]
    assert all(budgets.DEFAULT_S < s <= 120 for s in seconds)


def test_the_tests_with_budgets_are_the_slow_tier(request: pytest.FixtureRequest) -> None:
    """Every collected test listed in budgets.py is marked slow (`-m "not slow"` leaves it out)."""
    listed = [item for item in request.session.items if budgets.listed(item.nodeid)]
    assert all(item.get_closest_marker("slow") for item in listed)
    unlisted = [item for item in request.session.items if item not in listed]
    assert unlisted and request.node in unlisted


def test_a_sleeper_for_the_budget_check() -> None:
    """Run alone by the test below, with its budget scaled down to 25 ms."""
    time.sleep(0.1)


def test_pytest_reports_a_test_over_its_budget_and_fails_it_only_when_strict() -> None:
    """The real hooks in real pytest runs: the sleeper above, over a budget scaled below its time,
    passes with the budget's line in the summary, and fails with it in strict mode (with the check
    off it passes: overrun's test above)."""
    test = "tests/test_budgets.py::test_a_sleeper_for_the_budget_check"
    said = "its call took 0.1 s, over its budget of 0.0 s"
    outcomes = {}
    for strict in ("0", "1"):
        r = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-q", test],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env={
                **os.environ,
                "SMALLGPT_TEST_BUDGET": "0.005",
                "SMALLGPT_TEST_BUDGET_STRICT": strict,
            },
        )
        outcomes[strict] = r
        assert said in r.stdout, r.stdout
    reported = outcomes["0"]
    assert reported.returncode == 0 and "FAILED" not in reported.stdout, reported.stdout
    assert "time budgets" in reported.stdout and "1 over their time budgets" in reported.stdout
    failed = outcomes["1"]
    assert failed.returncode == 1 and f"FAILED {test}" in failed.stdout, failed.stdout


def test_strict_mode_is_0_or_1(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SMALLGPT_TEST_BUDGET_STRICT", "yes")
    with pytest.raises(ValueError, match=r"must be 0 \(report\) or 1 \(fail\)"):
        budgets.strict()
    monkeypatch.setenv("SMALLGPT_TEST_BUDGET_STRICT", "1")
    assert budgets.strict()
    monkeypatch.delenv("SMALLGPT_TEST_BUDGET_STRICT")
    assert not budgets.strict()
