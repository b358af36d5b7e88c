# The quick start's recipe before the fast one (AdamW, 2,000 iterations; about 5 minutes on a 2-core
# CPU), kept to compare with it side by side (docs/recipes.md):
#   python bench.py --mode=recipes \
#       --configs='[config/train_pycode_char_adamw.py,config/train_pycode_char.py]'
out_dir = "out-pycode-char-adamw"
eval_interval = 250
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
max_iters = 2000
lr_decay_iters = 2000
min_lr = 3e-4
warmup_iters = 100
beta2 = 0.99
