# The attention-variant comparison on a CPU: MHA vs GQA vs MQA, same data, seed and token budget (about 2 minutes
# per variant on 2 cores).  python compare.py config/compare/cpu.py [--convert=True]
# One variant alone (also under torchrun):
#   python train.py config/compare/cpu.py --n_kv_head=2 --out_dir=out-compare-cpu/gqa2
out_dir = "out-compare-cpu"
wandb_project = "smallgpt-compare"
eval_interval = 100
eval_iters = 40
log_interval = 50

dataset = "pycode_char"
batch_size = 16
block_size = 128

n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0
pos_encoding = "rope"

learning_rate = 3e-3
max_iters = 1000
lr_decay_iters = 1000
min_lr = 3e-4
warmup_iters = 100
seed = 1337
