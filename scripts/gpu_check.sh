#!/usr/bin/env bash
# The CUDA paths, once each, on a machine with one NVIDIA GPU (docs/gpu.md has what they gave):
#   bash scripts/gpu_check.sh paths      compiled bf16 training; sample.py with CUDA graphs (MHA/GQA/MQA, learned and
#                                        rotary, batch 1 and a padded batch) against the eager step; int8 on CUDA;
#                                        torchrun --nproc_per_node=1 with DDP (nccl) and FSDP in bf16, and FSDP's resume
#   bash scripts/gpu_check.sh mfu        GPT-2 124M training step, bf16, compiled, batch 16/32/64 (bench.py)
#   bash scripts/gpu_check.sh profile    the same step at batch 32 under torch.profiler: its costliest kernels
#   bash scripts/gpu_check.sh speedrun   bench.py --mode=nanogpt against a nanoGPT checkout in $NANOGPT_DIR
#   bash scripts/gpu_check.sh steps      the CUDA-graph step of local layers (rings) and MLA against the eager one
#                                        (scripts/cuda_steps.py); bf16 decoding to 4,096 tokens, all layers global
#                                        and 3 of 4 local (window 512), batch 1 and 16
#   bash scripts/gpu_check.sh hybrids    flash-linear-attention's gated delta rule against the torch one (fla_check.py);
#                                        the 3:1 hybrid's GPT-2-sized training step (fla, torch) beside MHA's; bf16
#                                        decoding to 4,096 tokens: the hybrid beside MHA, GQA 4, MLA 256 and SSSL
#                                        (needs fla importable: pip install flash-linear-attention)
# KV_HEADS='2' limits paths to those n_kv_head. Logs go to $OUT (or gpu-logs/). Each step prints "== rc=N"; a failed step does not stop the next.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG=${OUT:-gpu-logs}
T=${TMPDIR:-/tmp}/smallgpt-gpu
mkdir -p "$LOG" "$T"
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled

step() { echo "== $*"; "$@"; echo "== rc=$?"; }
same() { if cmp -s "$1" "$2"; then echo "== same text: $1 $2"; else echo "== DIFFERENT text: $1 $2"; diff "$1" "$2" | head -5; fi; }

paths() {
  nvidia-smi -L; $PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
  step $PY data/pycode_char/prepare.py
  printf 'def \nclass Foo(Bar):\n    return\n' > "$T/prompts.txt"
  local common="config/train_pycode_char.py --device=cuda --max_iters=300 --lr_decay_iters=300 --eval_interval=300
    --eval_iters=20 --log_interval=100"
  for pos in learned rope; do
    for kv in ${KV_HEADS:-4 2 1}; do  # of 4 heads
      local d="$T/$pos-$kv" compile=False
      [ "$kv" = 2 ] && compile=True
      step $PY train.py $common --pos_encoding=$pos --n_kv_head=$kv --compile=$compile --dtype=bfloat16 --out_dir="$d"
      for start in "def " "LINES:$T/prompts.txt"; do
        local tag=${start:0:5}
        for graph in True False; do
          $PY sample.py --out_dir="$d" --device=cuda --temperature=0 --max_new_tokens=200 --start="$start" \
            --cuda_graph=$graph > "$d/$tag-graph$graph.txt"; echo "== sample $pos kv=$kv $tag graph=$graph rc=$?"
        done
        same "$d/$tag-graphTrue.txt" "$d/$tag-graphFalse.txt"
      done
      $PY sample.py --out_dir="$d" --device=cuda --temperature=0 --max_new_tokens=200 --start="def " --quantize=int8 \
        > "$d/int8.txt"; echo "== int8 $pos kv=$kv rc=$?"
      same "$d/def -graphTrue.txt" "$d/int8.txt"
    done
  done
  step torchrun --standalone --nproc_per_node=1 train.py $common --dtype=bfloat16 --out_dir="$T/ddp"
  step torchrun --standalone --nproc_per_node=1 train.py $common --optimizer=adamw --parallel=fsdp --dtype=bfloat16 \
    --max_iters=200 --out_dir="$T/fsdp"
  step torchrun --standalone --nproc_per_node=1 train.py $common --optimizer=adamw --parallel=fsdp --dtype=bfloat16 \
    --init_from=resume --out_dir="$T/fsdp"
  tail -n 3 "$T/fsdp/log.jsonl"
}

mfu() {
  for b in 16 32 64; do
    step $PY bench.py --mode=train config/train_gpt2.py --device=cuda --dtypes='["bfloat16"]' --compiles='[True]' \
      --batch_size=$b --gradient_accumulation_steps=1 --warmup=5 --iters=20
  done
}

profile() {
  step $PY bench.py --mode=train config/train_gpt2.py --device=cuda --dtypes='["bfloat16"]' --compiles='[True]' \
    --batch_size=32 --gradient_accumulation_steps=1 --warmup=5 --iters=10 --profile=True
}

speedrun() {
  [ -f data/pycode_char/train.bin ] || step $PY data/pycode_char/prepare.py
  step $PY bench.py --mode=nanogpt --nanogpt_dir="${NANOGPT_DIR:?set NANOGPT_DIR to a karpathy/nanoGPT checkout}" \
    config/speedrun_gpu.py
}

steps() {
  PYTHONPATH=tests step $PY scripts/cuda_steps.py
  for pattern in L SSSL; do
    local window=""
    [ "$pattern" = L ] || window=--window=512
    step $PY bench.py --mode=decode --device=cuda --dtype=bfloat16 --n_layer=12 --n_head=12 --n_embd=768 \
      --block_size=8192 --vocab_size=50257 --batch_sizes='[1,16]' --new_tokens='[4096]' --repeats=1 \
      --recompute_max_batch=0 --kv_heads='[12]' --window_pattern=$pattern $window
  done
}

hybrids() {
  step $PY scripts/fla_check.py
  local gpt2="config/train_gpt2.py --device=cuda --dtypes=[\"bfloat16\"] --batch_size=16
    --gradient_accumulation_steps=1 --warmup=5 --iters=20"
  step $PY bench.py --mode=train $gpt2 --compiles='[True]'
  step $PY bench.py --mode=train $gpt2 --compiles='[False,True]' --layer_pattern=DDDL
  SMALLGPT_FLA=0 step $PY bench.py --mode=train $gpt2 --compiles='[True]' --layer_pattern=DDDL
  local decode="--mode=decode --device=cuda --dtype=bfloat16 --n_layer=12 --n_head=12 --n_embd=768
    --block_size=8192 --vocab_size=50257 --batch_sizes=[1,16] --new_tokens=[4096] --repeats=1
    --recompute_max_batch=0"
  step $PY bench.py $decode --kv_heads='[12,4]' --kv_lora_ranks='[256]'
  step $PY bench.py $decode --kv_heads='[12]' --layer_pattern=DDDL
  step $PY bench.py $decode --kv_heads='[12]' --window_pattern=SSSL --window=512
}

for what in "${@:-paths}"; do
  "$what" 2>&1 | tee "$LOG/$what.log"
done
