# A baby GPT on the embedded pycode_char dataset (Python stdlib source, char-level); about 5 minutes on a 2-core CPU.
# python train.py config/train_pycode_char.py   (attention variants: --n_kv_head=2 for GQA, --n_kv_head=1 for MQA)
out_dir = "out-pycode-char"
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
