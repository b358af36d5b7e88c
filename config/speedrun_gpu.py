# A GPU speedrun against karpathy/nanoGPT's config/train_shakespeare_char.py (6 layers, 6 heads, 384
# wide, block 256, batch 64, 5000 iterations, 21 evaluations of 200 batches): the same model size
# with rotary positions, Muon for the blocks' matrices (AdamW for the rest), bf16 and torch.compile,
# 2000 iterations and one evaluation at the end. Measured on an H100 (docs/gpu.md): the bench below
# runs both sides on the same data in one command.
#   python train.py config/speedrun_gpu.py
#   python bench.py --mode=nanogpt --nanogpt_dir=../nanoGPT config/speedrun_gpu.py
out_dir = "out-speedrun-gpu"
dataset = "pycode_char"
device = "cuda"
dtype = "bfloat16"
compile = True

n_layer = 6
n_head = 6
n_embd = 384
block_size = 256
batch_size = 64
gradient_accumulation_steps = 1
dropout = 0.1
pos_encoding = "rope"

optimizer = "muon"
muon_lr = 0.02
learning_rate = 2e-3  # AdamW's, for the embeddings, norms and biases
min_lr = 2e-4
beta2 = 0.99
warmup_iters = 100
max_iters = 2000
lr_decay_iters = 2000

eval_interval = 2000
eval_at_start = False
eval_iters = 200
log_interval = 100
always_save_checkpoint = True
