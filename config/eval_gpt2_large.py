# Evaluate OpenAI's gpt2-large on OpenWebText: config/eval_gpt2.py with another model.
# python train.py config/eval_gpt2_large.py
exec(open(__file__.replace("_large", "")).read())
out_dir = "out-eval-gpt2-large"
init_from = "gpt2-large"
