#!/usr/bin/env bash
# Create or reuse .venv, install the requirements, lint, and run the test suite (extra args go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
venv_setup requirements.txt requirements-dev.txt
ruff check .
python -m pytest "$@"
