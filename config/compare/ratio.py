# The ratio sweep: how many of a model's layers need to be softmax attention? Layer patterns from
# all attention to all recurrent at a fixed depth of 4 (LLLL, DLDL 1:1, DDDL 3:1 as Qwen3.5, DDDD),
# each at MHA's parameters and at its best of the sweep's rates, on MQAR with filler between the
# pairs and the queries (8 pairs, 32 tokens of filler, 8 queries: 64 tokens). The report lists
# them by the share of attention layers (loss, MQAR solved k/n, cache bytes, decode speed) and
# plots loss and recall against it; each run also measures MQAR at 1x to 8x its context
# (mqar_long). 7:1 needs 8 layers: --n_layer=8 and the variant mha-dddddddl. Recall past the
# trained length in more detail, per run: eval.py --out_dir=<run> --tasks=[needle].
#   python data/mqar/prepare.py --num_pairs=8 --seq_len=64 --out_dir=data/mqar_ratio
#   python compare.py config/compare/ratio.py --seeds=5 --lrs=[1e-3,3e-3,1e-2] --match=params \
#       --variants=[mha,mha-dl,mha-dddl,mha-d]
from pathlib import Path

exec((Path(__file__).parent / "mqar.py").read_text())
out_dir = "out-compare-ratio"
dataset = "mqar_ratio"
n_layer = 4
block_size = 63  # an example is 64 tokens
final_evals = ["mqar", "position", "mqar_long"]
