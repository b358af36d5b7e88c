# The attention-variant comparison on a CPU: MHA vs GQA vs MQA of the quick-start model (4 layers, 4 heads, 128
# wide, rotary), same data, seed and token budget: 1000 iterations, about 2 minutes per variant on 2 cores.
#   python compare.py config/compare/cpu.py [--convert=True]
# One variant alone (also under torchrun):
#   python train.py config/compare/cpu.py --n_kv_head=2 --out_dir=out-compare-cpu/gqa2
from pathlib import Path

exec((Path(__file__).parents[1] / "train_pycode_char.py").read_text())
out_dir = "out-compare-cpu"
wandb_project = "smallgpt-compare"
eval_interval = 100
max_iters = 1000
lr_decay_iters = 1000
