# A baby GPT on the embedded pycode_char dataset (Python stdlib source, char-level); about 2-3
# minutes on a 2-core CPU. The fast recipe (config/train_cpu_fast.py's): rotary positions, Muon for
# the blocks' matrices (AdamW for the rest), 900 iterations. The AdamW recipe it replaced:
# config/train_pycode_char_adamw.py (docs/recipes.md).
#   python train.py config/train_pycode_char.py
# Attention variants: --n_kv_head=2 for GQA, --n_kv_head=1 for MQA.
out_dir = "out-pycode-char"
eval_interval = 450
eval_at_start = False
eval_iters = 100
log_interval = 50

dataset = "pycode_char"
batch_size = 16
block_size = 128

n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0
pos_encoding = "rope"

optimizer = "muon"
muon_lr = 0.02
learning_rate = 3e-3  # AdamW's, for the embeddings, norms and biases
max_iters = 900
lr_decay_iters = 900
min_lr = 3e-4
warmup_iters = 50
beta2 = 0.99
