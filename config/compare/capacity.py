# Capacity curves (issue 88, docs/compare.md "Capacity curves"): each variant's MQAR accuracy
# against the number of key-value pairs at one width and length, trained on a mix of 4, 8, 16 and
# 32 pairs (every key asked, filler between the pairs and the queries) until the val accuracy
# reaches 0.99 (Zoology's early stop) or the budget; the report gives each count at its best rate
# (chosen on val, the test split reported), the solved seeds with their interval and the curve's
# knee, and keeps each run's results in capacity.csv. 4 layers, 4 heads, 64 wide, as the ratio
# sweep; 7:1 needs 8 layers (--n_layer=8 and the variant mha-dddddddl, with an 8-layer mha
# beside it).
#   python data/mqar/prepare.py --pairs_mix=[4,8,16,32] --seq_len=128 --train_examples=40000 \
#       --out_dir=data/mqar_capacity
#   python compare.py config/compare/capacity.py --seeds=3 --lrs=[1e-3,3e-3,1e-2] --match=params \
#       --solved_threshold=0.99 --variants=[mha,mha-dddl,mha-d]
from pathlib import Path

exec((Path(__file__).parent / "mqar.py").read_text())
out_dir = "out-compare-capacity"
dataset = "mqar_capacity"
n_layer = 4
block_size = 127  # an example is 128 tokens: 32 pairs and their 32 queries fill it
stop_at_accuracy = 0.99
eval_interval = 250
final_evals = ["mqar"]
