#!/usr/bin/env bash
# The main job, offline: create or reuse .venv, prepare pycode_char, train the baby GPT, sample from it.
# Extra arguments go to train.py (e.g. --n_kv_head=1 --out_dir=out-mqa).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
venv_setup requirements.txt
python data/pycode_char/prepare.py
python train.py config/train_pycode_char.py --init_from=auto "$@"  # run again: resumes its checkpoint
out_dir=$(python -c "import sys; from configurator import parse_config; from train import TrainConfig
print(parse_config(TrainConfig, sys.argv[1:]).out_dir)" config/train_pycode_char.py "$@")
python sample.py --out_dir="$out_dir" --start="def " --max_new_tokens=400 --temperature=0.8
