#!/usr/bin/env bash
# Create or reuse .venv, install the requirements, lint, and run the test suite (extra args go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
venv_setup requirements.txt requirements-dev.txt
ruff check .
# Two pytest-xdist workers: the suite's processes leave a core idle about a third of the time (g++, imports, one-
# thread ranks). OpenMP threads that sleep instead of spinning while they wait keep the workers' torch threads from
# taking each other's cores (docs/testing.md).
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
# Bytecode kept between runs (in __pycache__/, ignored by git), also where the environment turns it off: each
# worker would otherwise compile every module and rewrite every test's asserts again, 4-5 s of its start.
unset PYTHONDONTWRITEBYTECODE
python -m pytest -n 2 "$@"  # --dist loadgroup: pyproject.toml's addopts
