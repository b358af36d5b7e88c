# nanoGPT's shakespeare_char baby GPT (6 layers, 6 heads, 384 wide, block 256), sized for a GPU: a
# few minutes on an A100. Prepare first (offline: --input=path/to/input.txt):
#   python data/shakespeare_char/prepare.py
out_dir = "out-shakespeare-char"
eval_interval = 250
eval_iters = 200
log_interval = 10
always_save_checkpoint = False  # the model overfits: keep the best val loss only

wandb_project = "shakespeare-char"

dataset = "shakespeare_char"
gradient_accumulation_steps = 1
batch_size = 64
block_size = 256

n_layer = 6
n_head = 6
n_embd = 384
dropout = 0.2
# n_kv_head = 2  # GQA; 1 for MQA

learning_rate = 1e-3
max_iters = 5000
lr_decay_iters = 5000
min_lr = 1e-4
beta2 = 0.99
warmup_iters = 100

compile = True
