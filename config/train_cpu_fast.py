# karpathy/nanoGPT's CPU recipe (4 layers, 4 heads, 128 wide, block 64, batch 12, 2000 iterations, lr 1e-3,
# 200-batch evaluations every 250 iterations) reaches its loss in about twice the time this does on a 2-core CPU
# (README Performance): same model size, with rotary positions, a 3x higher peak learning rate over half the
# iterations, and one 200-batch evaluation at the end instead of nine.
#   python train.py config/train_cpu_fast.py
#   python bench.py --mode=nanogpt --nanogpt_dir=../nanoGPT config/train_cpu_fast.py   (side by side)
out_dir = "out-cpu-fast"
dataset = "pycode_char"
device = "cpu"
n_layer = 4
n_head = 4
n_embd = 128
block_size = 64
batch_size = 12
dropout = 0.0
pos_encoding = "rope"
learning_rate = 3e-3
min_lr = 3e-4
warmup_iters = 50
max_iters = 1000
lr_decay_iters = 1000
beta2 = 0.99
eval_interval = 1000
eval_iters = 200
log_interval = 100
