# MHA vs GQA vs MQA on multi-query associative recall (data/mqar: 8 key-value pairs, then 8 queries;
# 64 keys, 64 values, 32 tokens an example), at two widths: the loss counts only the answers, and
# each run's MQAR accuracy on the val examples goes into the report (docs/compare.md "Recall:
# MQAR").
#   python data/mqar/prepare.py
#   python compare.py config/compare/mqar.py --seeds=3 --sizes=[2x64,2x128]
out_dir = "out-compare-mqar"
wandb_project = "smallgpt-compare"
dataset = "mqar"
device = "cpu"
n_layer = 2
n_head = 4
n_embd = 64
block_size = 31  # an example is 32 tokens: 31 inputs, each predicting the next
batch_size = 64
dropout = 0.0
pos_encoding = "rope"
optimizer = (
    "muon"  # broke out of the "one of the example's values" plateau (~2.08 nats) within 1,500 steps
)
muon_lr = 0.02
learning_rate = 3e-3
min_lr = 3e-4
warmup_iters = 50
max_iters = 1500
lr_decay_iters = 1500
eval_interval = 500
eval_iters = 16  # 16 x 64 val examples, 8 answers each
log_interval = 250
final_evals = ["mqar", "position"]
