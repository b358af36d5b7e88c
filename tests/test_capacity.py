"""smallgpt/capacity.py: capacity curves and their knees from hand-written per-run results, each
number worked by hand (issue 88), including a variant whose seeds disagree."""

import dataclasses
from pathlib import Path

import pytest

from conftest import cli
from smallgpt.capacity import (
    Knee,
    RateRow,
    Result,
    by_rate,
    curves,
    knee,
    knees_differ,
    rates_table,
    read_results,
    results_of,
    sized,
    table,
    write_results,
)

THRESHOLD = 0.99

# accuracy by (pairs, rate) over seeds 0, 1, 2
ATTENTION = {
    (4, 1e-3): (1.0, 1.0, 1.0),  # ties 3e-3 at a mean of 1: the lower rate, at the edge
    (4, 3e-3): (1.0, 1.0, 1.0),
    (4, 1e-2): (0.5, 1.0, 1.0),
    (8, 1e-3): (0.9, 0.95, 0.99),
    (8, 3e-3): (1.0, 0.995, 0.999),  # best, worse on each side
    (8, 1e-2): (0.2, 0.3, 0.99),
    (16, 1e-3): (0.6, 0.7, 0.8),
    (16, 3e-3): (0.99, 1.0, 0.995),  # best, bracketed; 0.99 is solved (the threshold itself)
    (16, 1e-2): (0.1, 0.1, 0.1),
    (32, 1e-3): (0.3, 0.3, 0.3),
    (32, 3e-3): (0.5, 0.6, 0.4),
    (32, 1e-2): (0.99, 0.7, 0.2),  # mean 0.63, the best, at the top edge: 1 of 3 seeds solved
}
HYBRID = {
    (4, 1e-3): (1.0, 0.999, 1.0),
    (4, 3e-3): (0.98, 1.0, 1.0),
    (8, 1e-3): (0.995, 0.42, 0.991),  # the seeds disagree: 2 of 3 solved
    (8, 3e-3): (0.3, 0.3, 0.3),
    (16, 1e-3): (0.999, 1.0, 0.995),  # every seed again, past the first failure
    (16, 3e-3): (0.1, 0.1, 0.1),
}


def results() -> list[Result]:
    return [
        Result(variant, pairs, seed, lr, accuracy, accuracy, "4x64")  # val as test: chosen on it
        for variant, grid in (("attention", ATTENTION), ("hybrid", HYBRID))
        for (pairs, lr), by_seed in grid.items()
        for seed, accuracy in enumerate(by_seed)
    ]


def test_each_cell_takes_the_best_rate_and_says_whether_it_is_bracketed() -> None:
    got = curves(results(), THRESHOLD)
    attention = [(c.pairs, c.lr, c.bracketed, c.solved.k) for c in got["attention"]]
    assert attention == [
        (4, 1e-3, False, 3),
        (8, 3e-3, True, 3),
        (16, 3e-3, True, 3),
        (32, 1e-2, False, 1),
    ]
    hybrid = [(c.pairs, c.lr, c.bracketed, c.solved.k) for c in got["hybrid"]]
    assert hybrid == [(4, 1e-3, False, 3), (8, 1e-3, False, 2), (16, 1e-3, False, 3)]
    disagree = got["hybrid"][1]
    assert disagree.seeds == (0, 1, 2) and disagree.accuracies == (0.995, 0.42, 0.991)
    # 2/3: the Clopper-Pearson bounds are the roots of 3x^2 - 2x^3 = 0.025 (Beta(2, 2)'s cdf)
    # and of x^3 = 0.975 (Beta(3, 1)'s); the solved seeds' mean accuracy (0.995 + 0.991) / 2
    assert disagree.solved.low == pytest.approx(0.094299, abs=1e-6)
    assert disagree.solved.high == pytest.approx(0.975 ** (1 / 3), abs=1e-9)
    assert disagree.solved.accuracy == pytest.approx(0.993)


def test_the_knee_is_where_the_curve_first_falls() -> None:
    got = curves(results(), THRESHOLD)
    attention, hybrid = knee(got["attention"]), knee(got["hybrid"])
    assert (attention.pairs, attention.next_pairs) == (16, 32)
    assert attention.how == "every seed solved up to 16; 32 pairs solved in 1/3 seeds"
    assert (hybrid.pairs, hybrid.next_pairs) == (4, 8)
    assert "solved by every seed again at 16: not counted" in hybrid.how
    # the hybrid's capacity is below 8 pairs, attention's at least 16: the intervals part
    assert knees_differ(attention, hybrid) and knees_differ(hybrid, attention)
    assert not knees_differ(Knee(8, 32, ""), Knee(16, None, ""))  # [8, 32) holds 16 and more
    only_first = [c for c in got["attention"] if c.pairs <= 16]
    assert knee(only_first) == Knee(16, None, "every seed solved every count measured, up to 16")
    none = knee(got["attention"][3:])
    assert (none.pairs, none.next_pairs) == (None, 32) and none.how.endswith("the smallest")


def test_each_rate_is_summed_up_over_every_count() -> None:
    """By hand from the grids above: the mean val accuracy at 4 pairs, and the seeds that reached
    0.99 at every count (the hybrid's seed 1 fails at 8 pairs, so 2/3 at 1e-3)."""
    rows = by_rate(results(), THRESHOLD)
    assert [(r.variant, r.lr, r.solved, r.seeds) for r in rows] == [
        ("attention", 1e-3, 0, 3),  # every seed fails at 16 pairs
        ("attention", 3e-3, 0, 3),  # and here at 32
        ("attention", 1e-2, 0, 3),
        ("hybrid", 1e-3, 2, 3),
        ("hybrid", 3e-3, 0, 3),  # seeds 1 and 2 solve 4 pairs, none 8
    ]
    assert rows[2].val_accuracy == pytest.approx((0.5 + 1.0 + 1.0) / 3)
    assert rows[3] == RateRow("hybrid", 1e-3, 4, pytest.approx(2.999 / 3), 2, 3)
    text = rates_table(rows)
    assert "| variant | 0.001 | 0.003 | 0.01 |" in text
    assert "| attention | 1.000 (0/3) | 1.000 (0/3) | 0.833 (0/3) |" in text
    assert "| hybrid | 1.000 (2/3) | 0.993 (0/3) | - |" in text


def test_the_table_is_regenerated_from_the_kept_results(tmp_path: Path) -> None:
    path = tmp_path / "capacity.csv"
    write_results(path, results())
    assert read_results(path) == results()
    text = table(curves(read_results(path), THRESHOLD))
    assert (
        "| hybrid | 8 | 0.001 | no (at the edge of the rates tried) "
        "| 0: 0.995, 1: 0.420, 2: 0.991 |" in text
    )
    assert (
        "| attention | 16 | 32 | every seed solved up to 16; 32 pairs solved in 1/3 seeds |" in text
    )


def test_the_rate_is_chosen_on_val_and_the_test_accuracy_reported() -> None:
    # at 1e-3 val says solved and test does not; at 3e-3 the reverse: val's choice stands
    runs = [Result("w", 4, seed, 1e-3, 1.0, 0.9) for seed in range(3)]
    runs += [Result("w", 4, seed, 3e-3, 0.5, 1.0) for seed in range(3)]
    (cell,) = curves(runs, THRESHOLD)["w"]
    assert (cell.lr, cell.accuracies, cell.solved.k) == (1e-3, (0.9, 0.9, 0.9), 0)


def run_record(seed: int, rate: str | None, test: list, val: list, diverged: bool = False) -> dict:
    """A run as report.read_runs gives it, with its final evaluations' MQAR by pair count."""
    cells = [{"pairs": p, "accuracy": a} for p, a in test]
    return {
        "variant": "hybrid",
        "size": "4x64",
        "seed": seed,
        "rate": rate,
        "diverged": diverged,
        "config": {"learning_rate": 2e-3},
        "recall": None if diverged else {"mqar": {"accuracy": 0.5, "by_pairs": cells}},
        "evals": [{"val_mqar": {"by_pairs": [{"pairs": p, "accuracy": a} for p, a in val]}}],
    }


def test_results_are_read_from_the_runs_final_evaluations() -> None:
    runs = [
        run_record(1, "1e-3", [(4, 1.0), (8, 0.25)], [(4, 0.98), (8, 0.5)]),
        run_record(2, None, [(4, 0.75)], [(4, 0.5)]),  # no --lrs: the run's own rate
        run_record(3, "3e-3", [], [], diverged=True),  # recalls nothing, at every count measured
    ]
    assert results_of(runs) == [
        Result("hybrid", 4, 1, 1e-3, 0.98, 1.0, "4x64"),
        Result("hybrid", 8, 1, 1e-3, 0.5, 0.25, "4x64"),
        Result("hybrid", 4, 2, 2e-3, 0.5, 0.75, "4x64"),
        Result("hybrid", 4, 3, 3e-3, 0.0, 0.0, "4x64"),
        Result("hybrid", 8, 3, 3e-3, 0.0, 0.0, "4x64"),
    ]


def test_the_script_reads_a_protocols_parts_together_and_refuses_a_run_twice(
    tmp_path: Path,
) -> None:
    """Two parts of one protocol (the variants split), each its own file: the script's table is
    the one both give together; a part given twice is one line; a part at another size, of the
    same variants, seeds and rates, is other curves, each variant named by its size."""
    attention = [r for r in results() if r.variant == "attention"]
    hybrid = [r for r in results() if r.variant == "hybrid"]
    write_results(tmp_path / "a.csv", attention)
    write_results(tmp_path / "b.csv", hybrid)
    files = f"--files=[{tmp_path / 'a.csv'},{tmp_path / 'b.csv'}]"
    png = tmp_path / "curves.png"
    r = cli(["scripts/capacity_table.py", files, f"--png={png}"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(table(curves(results(), THRESHOLD)))
    assert rates_table(by_rate(results(), THRESHOLD)) in r.stdout
    assert r.stdout.endswith(f"wrote {png}\n")
    assert png.read_bytes().startswith(b"\x89PNG")
    twice = f"--files=[{tmp_path / 'a.csv'},{tmp_path / 'a.csv'}]"
    r = cli(["scripts/capacity_table.py", twice])
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "attention at 4 pairs, seed 0, rate 0.001 is in the files 2 times (36 such" in r.stderr
    deeper = [dataclasses.replace(r, size="8x64", accuracy=0.0) for r in attention]
    write_results(tmp_path / "c.csv", deeper)
    r = cli(["scripts/capacity_table.py", f"--files=[{tmp_path / 'a.csv'},{tmp_path / 'c.csv'}]"])
    assert r.returncode == 0, r.stderr
    by_variant = curves(sized(attention + deeper), THRESHOLD)
    assert list(by_variant) == ["4x64 attention", "8x64 attention"]
    assert r.stdout.startswith(table(by_variant))
    assert by_variant["4x64 attention"] == curves(attention, THRESHOLD)["attention"]
