#!/usr/bin/env bash
# Create or reuse .venv, install the requirements, lint, and run the test suite (extra args go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
venv_setup requirements.txt requirements-dev.txt
ruff check .
# The delta-rule CPU kernel built once before the tests (cached outside the repo: a line while it
# builds, nothing after), so that no test pays for it; a machine that cannot build it says so and
# tests the torch path (smallgpt/delta_rule_kernel.py)
python -c "from smallgpt import delta_rule_kernel; delta_rule_kernel.available()"
# Two pytest-xdist workers: the suite's processes leave a core idle about a third of the time (g++, imports, one-
# thread ranks). OpenMP threads that sleep instead of spinning while they wait keep the workers' torch threads from
# taking each other's cores (docs/testing.md).
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
python -m pytest -n 2 "$@"  # --dist loadgroup: pyproject.toml's addopts
