# Fine-tune OpenAI's GPT-2 XL on tiny shakespeare (GPT-2 BPE), as nanoGPT: a few minutes on one
# A100.
#   python data/shakespeare/prepare.py && python train.py config/finetune_shakespeare.py
# Into GQA/MQA on the way: --n_kv_head=5 (K/V heads mean-pooled in groups) ; smaller:
# --init_from=gpt2
out_dir = "out-shakespeare"
eval_interval = 5
eval_iters = 40
wandb_project = "shakespeare"

dataset = "shakespeare"
init_from = "gpt2-xl"
always_save_checkpoint = False  # keep the best val loss only

# 32,768 tokens per iteration: 1 * 32 * 1024; tiny shakespeare has 301,966 tokens, so 1 epoch ~ 9.2
# iterations
batch_size = 1
block_size = 1024
gradient_accumulation_steps = 32
max_iters = 20
dropout = 0.0

learning_rate = 3e-5  # constant
decay_lr = False
