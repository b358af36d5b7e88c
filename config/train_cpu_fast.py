# karpathy/nanoGPT's CPU recipe from its README (4 layers, 4 heads, 128 wide, block 64, batch 12,
# 2000 iterations, lr 1e-3, a 20-batch evaluation every 250 iterations) reaches its val loss in a
# fraction of the time with this on a 2-core CPU (docs/peers.md "Training to nanoGPT's loss"). Same
# model size, with rotary positions, Muon for the blocks' matrices (AdamW for the rest), twice the
# batch over 240 iterations, a short warm-up, and one evaluation at the end (100 batches of 24). The
# 300-iteration version before it: --max_iters=300 --lr_decay_iters=300 --muon_lr=0.02
# --warmup_iters=50 --min_lr=3e-4.
#   python train.py config/train_cpu_fast.py
# Both, side by side:
#   python bench.py --mode=nanogpt --nanogpt_dir=../nanoGPT config/train_cpu_fast.py
out_dir = "out-cpu-fast"
dataset = "pycode_char"
device = "cpu"
n_layer = 4
n_head = 4
n_embd = 128
block_size = 64
batch_size = 24
dropout = 0.0
pos_encoding = "rope"
optimizer = "muon"
muon_lr = 0.03
learning_rate = 3e-3  # AdamW's, for the embeddings, norms and biases
min_lr = 1e-3
warmup_iters = 10
max_iters = 240
lr_decay_iters = 240
beta2 = 0.99
eval_interval = 240
eval_at_start = False
eval_iters = 100
log_interval = 80
