# The attention-variant comparison on a CPU: MHA vs GQA vs MQA of the fast CPU recipe
# (config/train_cpu_fast.py: 4 layers, 4 heads, 128 wide, rotary, Muon, 240 iterations of 24 x 64
# tokens), the same data and token budget each.
#   python compare.py config/compare/cpu.py --seeds=3 [--match=[width,params]] [--convert=True ...]
# One variant alone (also under torchrun):
#   python train.py config/compare/cpu.py --n_kv_head=2 --out_dir=out-compare-cpu/gqa2
from pathlib import Path

exec((Path(__file__).parents[1] / "train_cpu_fast.py").read_text())
out_dir = "out-compare-cpu"
wandb_project = "smallgpt-compare"
eval_interval = 80
eval_iters = (
    50  # each run's evaluations share these batches, so their noise is common to all variants
)
