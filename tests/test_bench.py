import json

from conftest import run


def test_decode_bench_runs_and_reports_every_setting() -> None:
    r = run(["bench.py", "--n_layer=1", "--n_head=4", "--n_embd=32", "--block_size=16", "--kv_heads=[4,2,1]",
             "--new_tokens=[8,20]", "--batch_sizes=[1,2]", "--repeats=1", "--device=cpu"])
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [(x["n_kv_head"], x["batch"], x["new_tokens"]) for x in rows] == [
        (g, b, n) for g in (4, 2, 1) for b in (1, 2) for n in (8, 20)]
    for x in rows:
        assert x["cache_tok_s"] > 0 and x["kv_cache_bytes"] == 2 * 1 * x["batch"] * x["n_kv_head"] * min(
            x["new_tokens"], 16) * 8 * 4
        assert ("recompute_tok_s" in x) == (x["batch"] == 1)
    assert "| MQA | 1 | 2 | 20 |" in r.stdout
