"""Llama's block (norm='rmsnorm', mlp='swiglu') out to stock transformers classes, LlamaForCausalLM
(MHA, GQA, MQA) and a dense DeepseekV3ForCausalLM (MLA), and back through init_from=hf: the same
logits and greedy tokens; what no stock class holds exactly, refused in one line naming the keys."""

import dataclasses
import json
import string
from pathlib import Path

import pytest
import torch

from attention import NORM_EPS
from conftest import assert_same_greedy_tokens, cli
from model import GPT, GPTConfig
from smallgpt.checkpoint import load_run, parse_source, save_checkpoint
from smallgpt.errors import UserError
from smallgpt.gguf import llama_cpp_folder
from smallgpt.hf import from_hf, target_class, to_hf, tokenizer
from smallgpt.hf_llama import HF_LATENT_EPS

LLAMA = dict(
    block_size=32,
    vocab_size=61,
    n_layer=2,
    n_head=4,
    n_embd=32,
    pos_encoding="rope",
    norm="rmsnorm",
    mlp="swiglu",
    bias=False,
)
CASES = {
    "MHA": dict(n_kv_head=4),
    "GQA": dict(n_kv_head=2, bias=True, rope_theta=500.0),
    "MQA": dict(n_kv_head=1),
    "MLA": dict(kv_lora_rank=16),
    "MLA-q": dict(kv_lora_rank=8, q_lora_rank=12),
    "MLA-q-rope2": dict(kv_lora_rank=24, qk_rope_head_dim=2, q_lora_rank=16, rope_theta=500.0),
    # local layers: GraniteSWA
    "GQA-SL": dict(n_kv_head=2, n_layer=3, window=5, window_pattern="SL"),
    "MHA-S-bias": dict(n_kv_head=4, bias=True, window=7, window_pattern="S"),
}
CLASSES = {
    "MLA": "DeepseekV3ForCausalLM",
    "GQA-SL": "GraniteSWAForCausalLM",
    "MHA-S-bias": "GraniteSWAForCausalLM",
}


def sharp_model(**keys: object) -> GPT:
    """A random Llama-block model made decisive: matrices 4x GPT-2's scale, norm weights drawn from
    [3, 9] and biases from N(0, 0.2): its logits are peaked (max |logit| near 10), its greedy tokens
    depend on the context, and a norm or bias mapped to the wrong place shows."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**LLAMA | keys)).eval()
    draw = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(4)
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=draw))
            else:
                p.copy_(3 + 6 * torch.rand(p.shape, generator=draw))
    return model


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(
        0, 61, (3, 32), generator=torch.Generator().manual_seed(seed)
    )  # up to block_size


def logits(model: object, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(idx, targets=idx)[0] if isinstance(model, GPT) else model(idx).logits


def load_strict(folder: Path) -> object:
    """The folder in transformers' own class, every weight given and none left over."""
    from transformers import AutoModelForCausalLM

    hf, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return hf.eval()


@pytest.mark.parametrize("case", CASES)
def test_llama_block_exports_with_our_logits_greedy_tokens_and_comes_back(
    case: str, tmp_path: Path
) -> None:
    model, idx = sharp_model(**CASES[case]), tokens()
    to_hf(model).save_pretrained(tmp_path)
    hf = load_strict(tmp_path)
    expected = next(
        (name for prefix, name in CLASSES.items() if case.startswith(prefix)), "LlamaForCausalLM"
    )
    assert type(hf).__name__ == target_class(model.config) == expected
    ours = logits(model, idx)
    assert ours.abs().max() > 5  # peaked: a mapping error would show
    torch.testing.assert_close(logits(hf, idx), ours, rtol=0, atol=1e-4)
    assert_same_greedy_tokens(model, hf, idx[:, :8])
    # its cache holds what ours does: MLA's latent and rotary key, or n_kv_head K/V heads; a sliding
    # layer's the window - 1 positions before a token (ours: a ring of window slots, the token
    # written in before attending)
    with torch.no_grad():
        cache = hf(idx, use_cache=True).past_key_values
    window = model.config.window and model.config.window - 1
    assert sum(
        t.nbytes for layer in cache.layers for t in (layer.keys, layer.values)
    ) == dataclasses.replace(model.config, window=window).kv_cache_bytes(3, 32)
    back = load_run(parse_source(f"hf:{tmp_path}"), tokenizer=False).model.eval()
    assert back.config == model.config
    torch.testing.assert_close(
        logits(back, idx), ours, rtol=0, atol=1e-4
    )  # MLA's latent rows: scaled, then back


def test_a_new_export_target_is_a_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A family the table does not have, Mistral (Llama's block and weight names, no biases), added
    as one row before Llama's: export.py's path (to_hf) picks its class for a model it holds, with
    our logits, and from_hf reads its folder back (folder_model_type knows its model_type) to the
    same model; a model with biases still goes to Llama's class."""
    import transformers

    from smallgpt import hf
    from smallgpt.hf_llama import from_llama_block, llama, llama_class

    def without_names(config: object) -> dict:
        drop = ("model_type", "architectures", "transformers_version")
        return {k: v for k, v in config.to_dict().items() if k not in drop}

    def write(c: GPTConfig, sd: dict, llama_cpp: bool) -> tuple:
        _, config, state = llama(c, sd)  # Mistral's config keys and weight names are Llama's
        return "MistralForCausalLM", transformers.MistralConfig(**without_names(config)), state

    def read(folder: str, c: object, sd: dict) -> tuple:
        return from_llama_block(folder, transformers.LlamaConfig(**without_names(c)), sd)

    def holds(c: GPTConfig) -> bool:
        return llama_class(c) == "LlamaForCausalLM" and not c.bias

    mistral = hf.Target("MistralForCausalLM", holds, write, ("mistral",), read)
    monkeypatch.setattr(hf, "TARGETS", (mistral, *hf.TARGETS))
    model, idx = sharp_model(n_kv_head=2), tokens()
    exported = to_hf(model)
    assert type(exported).__name__ == "MistralForCausalLM"
    torch.testing.assert_close(logits(exported, idx), logits(model, idx), rtol=0, atol=1e-4)
    exported.save_pretrained(tmp_path)
    back = from_hf(str(tmp_path)).eval()
    assert back.config == model.config
    torch.testing.assert_close(logits(back, idx), logits(model, idx), rtol=0, atol=1e-4)
    assert target_class(sharp_model(n_kv_head=2, bias=True).config) == "LlamaForCausalLM"


def test_deepseek_folder_is_dense_with_rotary_halves_and_rescaled_latents(tmp_path: Path) -> None:
    model = sharp_model(kv_lora_rank=8, q_lora_rank=12)
    to_hf(model).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (
        config["first_k_dense_replace"] == config["num_hidden_layers"] == 2
        and config["n_routed_experts"] == 0
    )
    assert (config["rope_interleave"], config["tie_word_embeddings"], config["rms_norm_eps"]) == (
        False,
        True,
        1e-5,
    )
    assert (config["qk_nope_head_dim"], config["v_head_dim"], config["qk_rope_head_dim"]) == (
        8,
        8,
        4,
    )
    # transformers' latent norms keep their own epsilon whatever rms_norm_eps says: hf_llama
    # rescales for it
    attn = load_strict(tmp_path).model.layers[0].self_attn
    assert (
        attn.kv_a_layernorm.variance_epsilon
        == attn.q_a_layernorm.variance_epsilon
        == HF_LATENT_EPS
        != NORM_EPS
    )


def test_small_latents_keep_our_norm_epsilon_in_transformers() -> None:
    """Latents 10x smaller than sharp_model's, where transformers' latent epsilon (1e-6, not
    rms_norm_eps) would change the logits: the rescaled rows (hf_llama.LATENT_SCALE) keep them ours;
    unscaled, they move 1e-3 or more."""
    model, idx = sharp_model(**CASES["MLA-q"]), tokens()
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.kv_a.weight[:8].mul_(0.1)  # the latent's rows, not the rotary key's
            block.attn.q_a.weight.mul_(0.1)
    ours = logits(model, idx)
    torch.testing.assert_close(logits(to_hf(model), idx), ours, rtol=0, atol=1e-4)
    assert (
        logits(to_hf(model, llama_cpp=True), idx) - ours
    ).abs().max() > 1e-3  # the llama.cpp folder: unscaled


@pytest.mark.parametrize("case", ["MLA", "MLA-q"])
def test_llama_cpp_folder_rotates_pairs_and_comes_back(case: str, tmp_path: Path) -> None:
    """llama.cpp's deepseek2 rotates pairs and normalises the latents with rms_norm_eps: its folder,
    read so, is ours; read as transformers reads it (rope_interleave=True), it comes back through
    init_from=hf: as it computes."""
    model, idx = sharp_model(**CASES[case]), tokens()
    hf = to_hf(model, llama_cpp=True)
    assert hf.config.rope_interleave
    hf.save_pretrained(tmp_path)
    as_transformers = logits(hf, idx)
    for layer in hf.model.layers:  # as llama.cpp reads it
        for norm in (layer.self_attn.kv_a_layernorm, layer.self_attn.q_a_layernorm):
            if norm is not None:
                norm.variance_epsilon = NORM_EPS
    torch.testing.assert_close(logits(hf, idx), logits(model, idx), rtol=0, atol=1e-4)
    torch.testing.assert_close(
        logits(from_hf(str(tmp_path)).eval(), idx), as_transformers, rtol=0, atol=1e-4
    )
    meta = {"tokenizer": "char", "chars": list(string.printable[:61])}
    llama_cpp_folder(
        model, tokenizer(meta), tmp_path / "gguf"
    )  # q_lora_rank=0: no query latent, in llama.cpp
    config = json.loads((tmp_path / "gguf" / "config.json").read_text())
    assert config["q_lora_rank"] == (0 if case == "MLA" else 12) and config["rope_interleave"]


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (
            dict(kv_lora_rank=16, norm="layernorm", mlp="gelu"),
            "export needs norm='rmsnorm' and mlp='swiglu' for MLA (DeepseekV3ForCausalLM",
        ),
        (
            dict(kv_lora_rank=16, latent_norm=False),
            "export needs latent_norm=True for MLA (DeepseekV3ForCausalLM",
        ),
        (
            dict(kv_lora_rank=16, bias=True, mlp="gelu"),
            (
                "export needs norm='rmsnorm' and mlp='swiglu', "
                "bias=False for MLA (DeepseekV3ForCausalLM"
            ),
        ),
        (dict(kv_lora_rank=16, pos_encoding="learned"), "export needs pos_encoding='rope' for MLA"),
        (
            dict(pos_encoding="learned"),
            "export needs pos_encoding='rope' for Llama's block (LlamaForCausalLM)",
        ),
        (
            dict(mlp="gelu"),
            "holds norm='rmsnorm' with mlp='gelu': export needs norm='rmsnorm' with mlp='swiglu'",
        ),
        (
            dict(norm="layernorm", bias=True),
            "holds norm='layernorm' with mlp='swiglu': export needs",
        ),
        (
            dict(window=4, window_pattern="S", norm="layernorm", mlp="gelu"),
            "exporting local layers (window) needs "
            "norm='rmsnorm', mlp='swiglu' and pos_encoding='rope' (GraniteSWAForCausalLM",
        ),
        (
            dict(window=4, window_pattern="S", pos_encoding="learned"),
            "no stock class holds them with norm='rmsnorm', mlp='swiglu', pos_encoding='learned'",
        ),
        (
            dict(window=4, window_pattern="S", kv_lora_rank=16),
            "export needs no window for MLA (DeepseekV3ForCausalLM",
        ),
    ],
)
def test_what_no_stock_class_holds_is_refused_in_one_line_naming_the_keys(
    keys: dict, message: str
) -> None:
    model = GPT(GPTConfig(**LLAMA | keys))
    for call in (lambda: target_class(model.config), lambda: to_hf(model)):
        with pytest.raises(UserError) as e:
            call()
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize(
    ("case", "changes", "message"),
    [
        (
            "GQA",
            {
                "tie_word_embeddings": False,
                "rms_norm_eps": 1e-6,
                "hidden_act": "gelu",
                "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
            },
            (
                "cannot hold tie_word_embeddings=False, hidden_act='gelu', "
                "rms_norm_eps=1e-06, rope_type='linear'"
            ),
        ),
        ("GQA", {"mlp_bias": False}, "cannot hold attention_bias=True with mlp_bias=False"),
        (
            "MLA",
            {
                "first_k_dense_replace": 1,
                "n_routed_experts": 4,
                "num_experts_per_tok": 2,
                "n_group": 1,
                "topk_group": 1,
            },
            "cannot hold experts (first_k_dense_replace=1 < num_hidden_layers=2)",
        ),
        (
            "MLA",
            {"v_head_dim": 4, "attention_bias": True},
            "cannot hold attention_bias=True, qk_nope_head_dim=8, v_head_dim=4 (ours: both",
        ),
        (
            "GQA-SL",
            {"embedding_multiplier": 2.0},
            "cannot hold embedding_multiplier=2.0, residual_multiplier=1.0, "
            "logits_scaling=1.0 (ours: 1)",
        ),
        (
            "GQA-SL",
            {"layer_rope_theta": [10000.0, 0, 500.0]},
            "cannot hold a rope base per layer",
        ),
        (
            "GQA-SL",
            {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
            "layer_types ending in 'sliding_attention' (our last layer is always global)",
        ),
    ],
)
def test_a_folder_our_model_cannot_hold_is_refused_in_one_line(
    case: str, changes: dict, message: str, tmp_path: Path
) -> None:
    hf = to_hf(sharp_model(**CASES[case]))
    for key, value in changes.items():
        setattr(hf.config, key, value)
    type(hf)(hf.config).save_pretrained(tmp_path)  # a model of that config, its weights drawn anew
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        from_hf(str(tmp_path))
    assert "\n" not in str(e.value)


def write_run(out: Path, **keys: object) -> None:
    """A run folder holding a checkpoint of a sharpened model on a char-level dataset's 61
    characters."""
    meta = {"tokenizer": "char", "vocab_size": 61, "chars": list(string.printable[:61])}
    out.mkdir()
    save_checkpoint(
        out / "ckpt.pt",
        sharp_model(**keys),
        data_meta=meta,
        iter_num=0,
        config={"dataset": "chars"},
    )


def test_export_py_writes_the_class_in_its_card_refuses_in_one_line_and_sample_py_reads_it(
    tmp_path: Path,
) -> None:
    write_run(tmp_path / "mla", kv_lora_rank=16)
    r = cli(["export.py", f"--out_dir={tmp_path / 'mla'}", f"--to={tmp_path / 'hf'}"])
    assert r.returncode == 0 and "DeepseekV3ForCausalLM, MLA (" in r.stdout, r.stderr
    card = (tmp_path / "hf" / "README.md").read_text()
    assert (
        "`DeepseekV3ForCausalLM`" in card
        and "kv_lora_rank=16, qk_rope_head_dim=4, q_lora_rank=None" in card
    )
    r = cli(
        [
            "sample.py",
            f"--init_from=hf:{tmp_path / 'hf'}",
            "--start=def",
            "--max_new_tokens=8",
            "--device=cpu",
        ]
    )
    assert r.returncode == 0 and r.stdout.startswith("def"), r.stderr
    write_run(tmp_path / "local", n_kv_head=2, window=5, window_pattern="S")
    r = cli(["export.py", f"--out_dir={tmp_path / 'local'}", f"--to={tmp_path / 'hf3'}"])
    assert r.returncode == 0 and "GraniteSWAForCausalLM, GQA (" in r.stdout, r.stderr
    assert (
        "Local layers [0] of 2 (window_pattern='SL') attend over their last 5 tokens"
        in (tmp_path / "hf3" / "README.md").read_text()
    )
    write_run(tmp_path / "plain", kv_lora_rank=16, latent_norm=False)
    r = cli(["export.py", f"--out_dir={tmp_path / 'plain'}", f"--to={tmp_path / 'hf2'}"])
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert (
        r.stderr.startswith("error: export needs latent_norm=True for MLA")
        and not (tmp_path / "hf2").exists()
    )
