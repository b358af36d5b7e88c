# Evaluate OpenAI's gpt2 on OpenWebText (python data/openwebtext/prepare.py first): train/val loss,
# no training.
#   python train.py config/eval_gpt2.py
out_dir = "out-eval-gpt2"
init_from = "gpt2"
dataset = "openwebtext"
eval_only = True
batch_size = 8
block_size = 1024
eval_iters = 500  # more iterations, a better estimate
wandb_log = False
