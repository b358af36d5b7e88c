# The attention-variant comparison at GPU scale: 8 layers, 8 heads (MHA, GQA with 4 K/V heads, MQA),
# block 512, on pycode_char (or --dataset=shakespeare_char).
#   python compare.py config/compare/gpu.py [--convert=True]
out_dir = "out-compare-gpu"
wandb_log = True
wandb_project = "smallgpt-compare"
eval_interval = 250
eval_iters = 100
log_interval = 25

dataset = "pycode_char"
batch_size = 64
block_size = 512

n_layer = 8
n_head = 8
n_embd = 512
dropout = 0.0
pos_encoding = "rope"

learning_rate = 1e-3
max_iters = 5000
lr_decay_iters = 5000
min_lr = 1e-4
warmup_iters = 200
beta2 = 0.99
seed = 1337
compile = True
