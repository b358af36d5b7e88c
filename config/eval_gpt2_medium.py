# Evaluate OpenAI's gpt2-medium on OpenWebText: config/eval_gpt2.py with another model.
# python train.py config/eval_gpt2_medium.py
exec(open(__file__.replace("_medium", "")).read())
out_dir = "out-eval-gpt2-medium"
init_from = "gpt2-medium"
