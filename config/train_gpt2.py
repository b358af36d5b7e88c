# GPT-2 (124M) on OpenWebText, as nanoGPT: 8 GPUs with DDP,
#   torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py
# 12 batch * 1024 block * 40 accumulation = 491,520 tokens per iteration; 600k iterations, about
# 300B tokens.
out_dir = "out-gpt2"
wandb_log = True
wandb_project = "owt"
wandb_run_name = "gpt2-124M"

dataset = "openwebtext"
batch_size = 12
block_size = 1024
gradient_accumulation_steps = 5 * 8

n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0
bias = False
# n_kv_head = 4  # GQA: a 3x smaller KV cache for decoding

learning_rate = 6e-4
max_iters = 600000
lr_decay_iters = 600000
min_lr = 6e-5
weight_decay = 1e-1
beta2 = 0.95
warmup_iters = 2000

eval_interval = 1000
eval_iters = 200
log_interval = 10
compile = True
