# Evaluate OpenAI's gpt2-xl on OpenWebText: config/eval_gpt2.py with another model.
# python train.py config/eval_gpt2_xl.py
exec(open(__file__.replace("_xl", "")).read())
out_dir = "out-eval-gpt2-xl"
init_from = "gpt2-xl"
