# GPT-2 XL (1.56B parameters) on OpenWebText with FSDP: each of 8 GPUs holds an eighth of the
# weights, gradients and AdamW moments (~3.1 GB instead of DDP's ~25 GB: docs/training.md), so the
# rest of the memory is for activations.
#   torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2_xl_fsdp.py
# Several nodes: the same with --nnodes/--rdzv_endpoint; out_dir must be on a file system every node
# sees. 8 batch * 1024 block * 64 accumulation = 524,288 tokens per iteration.
out_dir = "out-gpt2-xl"
wandb_log = True
wandb_project = "owt"
wandb_run_name = "gpt2-xl-fsdp"
# resume after a restart or pre-emption (sharded checkpoints, readable at any process count)
init_from = "auto"

dataset = "openwebtext"
batch_size = 8
block_size = 1024
gradient_accumulation_steps = 8 * 8

n_layer = 48
n_head = 25
n_embd = 1600
dropout = 0.0
bias = False

parallel = "fsdp"
dtype = "bfloat16"  # FSDP computes in bf16 and reduces gradients in fp32
compile = True

learning_rate = 2e-4  # GPT-3's rate at this size (its 1.3B model)
max_iters = 600000
lr_decay_iters = 600000
min_lr = 2e-5
weight_decay = 1e-1
beta2 = 0.95
warmup_iters = 2000

eval_interval = 1000
eval_iters = 200
log_interval = 10
