"""Gated DeltaNet layers beside attention (issue 58): the layer against transformers' own
Qwen3_5GatedDeltaNet on random weights, the attention options (an output gate, q/k norms, a rotary
fraction) against what they reduce to and against Qwen3.5's rotation, layer_pattern's letters and
its mistakes, decoding through the recurrent state against recomputation, and the bugs a test
must catch (a convolution state off by one, a pad that enters the state, the write strength
dropped). Each decoding path with a hybrid model is in test_decode_matrix.py."""

import copy
import dataclasses
from pathlib import Path

import pytest
import torch

from attention import rotate
from conftest import QWEN, exported_logits, lively, tiny_model
from gated_deltanet import GatedDeltaNet
from model import GPT, GPTConfig
from smallgpt.checkpoint import load_run, parse_source
from smallgpt.generation import generate, left_pad


def qwen_layer(ours: GatedDeltaNet) -> torch.nn.Module:
    """transformers' Qwen3_5GatedDeltaNet holding our layer's weights (test-only import)."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    C = ours.c_qkv.in_features
    config = Qwen3_5TextConfig(
        hidden_size=C,
        linear_num_key_heads=ours.n_head,
        linear_num_value_heads=ours.n_head,
        linear_key_head_dim=ours.head_dim,
        linear_value_head_dim=ours.head_dim,
        linear_conv_kernel_dim=ours.kernel,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    theirs = Qwen3_5GatedDeltaNet(config, 0)
    names = dict(
        in_proj_qkv="c_qkv",
        in_proj_z="c_z",
        in_proj_b="c_b",
        in_proj_a="c_a",
        out_proj="c_proj",
    )
    with torch.no_grad():
        for hf, mine in names.items():
            getattr(theirs, hf).weight.copy_(getattr(ours, mine).weight)
        theirs.conv1d.weight.copy_(ours.conv)
        theirs.A_log.copy_(ours.A_log)
        theirs.dt_bias.copy_(ours.dt_bias)
        theirs.norm.weight.copy_(ours.norm.weight)
    return theirs.eval()


@pytest.mark.parametrize(("n_embd", "n_head", "T"), [(32, 4, 37), (48, 2, 70), (16, 1, 5)])
def test_the_layer_is_transformers_qwen3_5_gated_deltanet(n_embd: int, n_head: int, T: int) -> None:
    """Random weights (the norm's too, dt_bias and A_log as initialised) of several shapes, T
    below, across and not a multiple of the chunk: our layer's output is transformers'."""
    torch.manual_seed(n_embd + T)
    m = GPT(
        GPTConfig(
            **QWEN,
            n_layer=1,
            n_head=n_head,
            n_embd=n_embd,
            block_size=128,
            vocab_size=61,
            layer_pattern="D",
        )
    )
    ours = m.transformer.h[0].attn
    with torch.no_grad():
        for p in ours.parameters():
            if p.dim() == 2:
                p.mul_(10.0)  # sharp: the state's products, not the norm's eps, decide
        ours.norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, T, n_embd)
    with torch.no_grad():
        want = qwen_layer(ours)(x)
        got = ours(x, None, None, None)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert want.std() > 0.01


def attention_model(**overrides: object) -> GPT:
    torch.manual_seed(0)
    return lively(tiny_model(2, pos_encoding="rope", **overrides))


@pytest.mark.parametrize("kind", ["head", "element"])
def test_a_gate_open_wide_is_attention_without_one(kind: str) -> None:
    """The output gate's bias at +30 and its weights 0 (sigmoid = 1): the model's logits are those
    of the same weights without a gate; with the bias at 0 they are not."""
    plain = attention_model(n_layer=2)
    gated = GPT(dataclasses.replace(plain.config, attn_gate=kind)).eval()
    missing, unexpected = gated.load_state_dict(plain.state_dict(), strict=False)
    assert unexpected == [] and all(".attn.gate.c_gate." in k for k in missing)
    idx = torch.randint(0, 61, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for block in gated.transformer.h:
            block.attn.gate.c_gate.weight.zero_()
            block.attn.gate.c_gate.bias.fill_(30.0)
        torch.testing.assert_close(gated(idx, idx)[0], plain(idx, idx)[0])
        for block in gated.transformer.h:
            block.attn.gate.c_gate.bias.zero_()  # sigmoid(0) = 1/2 on every feature
        assert not torch.allclose(gated(idx, idx)[0], plain(idx, idx)[0], atol=1e-3)


def test_a_rotary_fraction_rotates_the_first_features_as_qwen3_5_does() -> None:
    """rope_fraction=1 rotates every feature (the model of the default key); 0.25 rotates the first
    quarter by tables of that width and leaves the rest, as Qwen3.5's apply_rotary_pos_emb does
    with partial_rotary_factor=0.25."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

    shape = dict(n_layer=1, n_head=2, n_embd=64, block_size=16, vocab_size=61, pos_encoding="rope")
    full = GPTConfig(**shape)
    quarter = GPTConfig(**shape, rope_fraction=0.25)
    assert full.rope_dim == 32 and quarter.rope_dim == 8
    m = GPT(quarter)
    x = torch.randn(1, 2, 16, 32)
    pos = torch.arange(16)
    _, (cos, sin) = m.embed(torch.zeros(1, 16, dtype=torch.long), pos)
    got = rotate(x, (cos, sin))
    # theirs: cos and sin of the rotated width, each half repeated, (1, T, 8)
    hf_cos = torch.cat((cos, cos), dim=-1)[:, 0]
    hf_sin = torch.cat((sin, sin), dim=-1)[:, 0]
    want, _ = apply_rotary_pos_emb(x, x, hf_cos, hf_sin)
    torch.testing.assert_close(got, want)
    assert torch.equal(got[..., 8:], x[..., 8:]) and not torch.allclose(got[..., :8], x[..., :8])
    m_full = GPT(full)
    _, (cos, sin) = m_full.embed(torch.zeros(1, 16, dtype=torch.long), pos)
    want, _ = apply_rotary_pos_emb(
        x, x, torch.cat((cos, cos), -1)[:, 0], torch.cat((sin, sin), -1)[:, 0]
    )
    torch.testing.assert_close(rotate(x, (cos, sin)), want)


def test_qk_norm_normalises_each_heads_queries_and_keys() -> None:
    """With qk_norm, scaling c_q's and c_k's weights changes nothing (the norms undo it), and
    without it the logits move."""
    idx = torch.randint(0, 61, (2, 20), generator=torch.Generator().manual_seed(2))
    for qk_norm in (True, False):
        m = attention_model(qk_norm=qk_norm)
        with torch.no_grad():
            before = m(idx, idx)[0]
            for block in m.transformer.h:
                block.attn.c_q.weight.mul_(3.0)
                block.attn.c_k.weight.mul_(3.0)
                block.attn.c_q.bias.mul_(3.0)
                block.attn.c_k.bias.mul_(3.0)
            after = m(idx, idx)[0]
        assert torch.allclose(before, after, atol=1e-5) == qk_norm


def test_layer_pattern_names_each_layers_mixer() -> None:
    """Letters repeated over the layers, the last never local; window_pattern is the S/L
    spelling of the same thing."""
    base = dict(n_layer=6, n_head=4, n_embd=32, block_size=32)
    c = GPTConfig(**base, layer_pattern="DDDL")
    assert c.layer_letters == "DDDLDD" and c.recurrent_layers == [0, 1, 2, 4, 5]
    c = GPTConfig(**base, layer_pattern="DSL", window=8)
    assert c.layer_letters == "DSLDSL" and c.local_layers == [1, 4]
    c = GPTConfig(**base, layer_pattern="SD", window=8)
    assert c.layer_letters == "SDSDSD"
    assert (
        GPTConfig(**base, layer_pattern="SSL", window=8).layer_windows
        == GPTConfig(**base, window_pattern="SSL", window=8).layer_windows
    )
    assert GPTConfig(**base, layer_pattern="S", window=8).layer_letters == "SSSSSL"
    assert (
        "Gated DeltaNet layers [0, 1, 2, 4, 5] of 6"
        in GPTConfig(**base, layer_pattern="DDDL").describe()
    )


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (
            dict(layer_pattern="DXL"),
            ["layer_pattern='DXL' must be letters L", "D (Gated DeltaNet)"],
        ),
        (dict(layer_pattern="ddl"), ["its letters are upper case, layer_pattern='DDL'"]),
        (
            dict(layer_pattern="DSL"),
            ["layer_pattern='DSL' has local layers (S): give their window"],
        ),
        (dict(layer_pattern="DL", window_pattern="SL", window=4), ["give one"]),
        (dict(layer_pattern="DL", window=4), ["no layer is local"]),
        (dict(attn_gate="yes"), ["attn_gate='yes' must be one of none, head, element"]),
        (dict(rope_fraction=0.2, pos_encoding="rope"), ["rotates int(8 * 0.2) = 1 features"]),
        (
            dict(rope_fraction=1.5, pos_encoding="rope"),
            ["rope_fraction=1.5 must be a number in (0, 1]"],
        ),
        (dict(rope_fraction=0.5), ["rope_fraction=0.5 applies to rotary positions"]),
        (
            dict(qk_norm=True, kv_lora_rank=8, pos_encoding="rope"),
            ["qk_norm=True does not apply to MLA"],
        ),
        (
            dict(layer_pattern="D", attn_gate="element"),
            ["attn_gate='element' is read only by global and local attention layers (L, S)"],
        ),
    ],
)
def test_bad_pattern_and_gate_keys_are_one_line(overrides: dict, names: list[str]) -> None:
    base = dict(n_layer=4, n_head=4, n_embd=32, block_size=32)
    with pytest.raises(ValueError) as e:
        GPTConfig(**(base | overrides))
    assert "\n" not in str(e.value)
    for name in names:
        assert name in str(e.value)


def hybrid(**overrides: object) -> GPT:
    """A lively 3-layer hybrid: a Gated DeltaNet layer, a local one and a global one (GQA with
    Qwen3.5's attention), its recurrent layers sharp too."""
    torch.manual_seed(0)
    config = QWEN | dict(
        n_layer=3, n_kv_head=2, layer_pattern="DSL", window=8, attn_gate="element", qk_norm=True
    )
    return lively(tiny_model(**(config | overrides)))


def test_prefill_then_steps_is_one_forward_and_cut_anywhere() -> None:
    """Prefills of 1, 5 and 13 tokens then one-token steps through the cache: the logits of one
    forward of the whole sequence, and a second prefill chunk after the first too."""
    m = hybrid()
    idx = torch.randint(0, 61, (2, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = m(idx, idx)[0]
        for prefill in (1, 5, 13):
            cache = m.make_kv_cache(2, 32)
            outs = [m(idx[:, :prefill], kv_cache=cache)[0]]
            outs += [m(idx[:, t : t + 1], kv_cache=cache)[0] for t in range(prefill, 30)]
            torch.testing.assert_close(
                torch.cat(outs, 1), full[:, prefill - 1 :], atol=2e-5, rtol=1e-4
            )
        cache = m.make_kv_cache(2, 32)
        m(idx[:, :9], kv_cache=cache)
        second = m(idx[:, 9:30], kv_cache=cache, targets=idx[:, 9:30])[0]
    torch.testing.assert_close(second, full[:, 9:30], atol=2e-5, rtol=1e-4)
    assert full.std() > 0.1


def test_the_kernel_path_takes_fla_s_layout_and_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA with flash-linear-attention installed the layer runs fla's chunk_gated_delta_rule
    through delta_rule.on_kernels. Here transformers' pure-torch function of the same contract
    ((B, T, H, d) in and out, a state in and out) stands in for it: a prefill of 70 tokens then 30
    more from the cache give the torch path's logits, so the transposes, the scale and the state
    handed over are right. (The kernels themselves are checked on a GPU: scripts/fla_check.py.)"""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    from smallgpt import delta_rule

    calls = []

    def fla_like(q, k, v, g, beta, scale, initial_state, output_final_state):  # noqa: ANN001, ANN202
        calls.append(initial_state is None)
        q = q * scale * q.size(-1) ** 0.5  # transformers' function scales q by d**-0.5 itself
        return qwen.torch_chunk_gated_delta_rule(
            q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state
        )

    m = hybrid(block_size=128)
    idx = torch.randint(0, 61, (2, 100), generator=torch.Generator().manual_seed(4))

    def without_then_with_cache() -> torch.Tensor:
        cache = m.make_kv_cache(2, 100)
        with torch.no_grad():
            whole = m(idx, idx)[0]
            first = m(idx[:, :70], kv_cache=cache, targets=idx[:, :70])[0]
            second = m(idx[:, 70:], kv_cache=cache, targets=idx[:, 70:])[0]
        return torch.cat((whole, first, second), 1)

    assert delta_rule.kernels_for(idx.float()) is None  # never on CPU
    expected = without_then_with_cache()
    monkeypatch.setattr(delta_rule, "kernels_for", lambda q: fla_like)
    torch.testing.assert_close(without_then_with_cache(), expected, atol=2e-5, rtol=1e-4)
    assert calls == [True, False, False]  # one recurrent layer: no state, then the cache's
    assert expected.std() > 0.1


def planted_runs(m: GPT) -> tuple[bool, bool]:
    """Whether m's cached steps equal its full forward, and whether a padded batch decodes what
    each prompt does alone."""
    idx = torch.randint(0, 61, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = m(idx, idx)[0]
        cache = m.make_kv_cache(2, 32)
        outs = [m(idx[:, :6], kv_cache=cache)[0]]
        outs += [m(idx[:, t : t + 1], kv_cache=cache)[0] for t in range(6, 24)]
        steps = torch.allclose(torch.cat(outs, 1), full[:, 5:], atol=1e-4)
        rows = [[5, 9, 2, 7, 1, 30, 4, 8, 11], [3, 6, 9], list(range(10, 24))]
        batch_idx, pad = left_pad(rows)
        batch = generate(m, batch_idx, 12, temperature=0, pad=pad)[:, -12:]
        alone = [generate(m, torch.tensor([r]), 12, temperature=0)[0, -12:] for r in rows]
    padded = [b.tolist() for b in batch] == [a.tolist() for a in alone]
    return steps, padded


def test_the_bugs_a_recurrent_layer_can_have_fail_these_tests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sound: both hold. The convolution's remembered inputs one step off, a pad that enters the
    state, or the write strength dropped (b = 1): one of them fails."""
    m = hybrid()
    assert planted_runs(m) == (True, True)
    import gated_deltanet

    forward = GatedDeltaNet.forward
    real_tokens = gated_deltanet.real_tokens

    def off_by_one(self, x, rope, mask, kv_cache):  # noqa: ANN001, ANN202
        if kv_cache is not None:
            write_state = kv_cache.write_state

            def shifted(layer, conv, state):  # noqa: ANN001, ANN202
                write_state(
                    layer, torch.cat((torch.zeros_like(conv[..., :1]), conv[..., :-1]), -1), state
                )

            kv_cache = copy.copy(kv_cache)
            kv_cache.write_state = shifted
        return forward(self, x, rope, mask, kv_cache)

    monkeypatch.setattr(GatedDeltaNet, "forward", off_by_one)
    assert planted_runs(m)[0] is False
    monkeypatch.setattr(GatedDeltaNet, "forward", forward)
    monkeypatch.setattr(gated_deltanet, "real_tokens", lambda *args: None)
    assert planted_runs(m)[1] is False
    monkeypatch.setattr(gated_deltanet, "real_tokens", real_tokens)
    # b dropped: the layer is no longer transformers'
    from smallgpt import delta_rule

    sequence = delta_rule.sequence  # the kernel on a CPU where it builds, else chunked

    def without_b(q, k, v, g, b, *rest):  # noqa: ANN001, ANN202
        return sequence(q, k, v, g, torch.ones_like(b), *rest)

    layer = m.transformer.h[0].attn
    x = torch.randn(2, 20, 32)
    with torch.no_grad():
        want = qwen_layer(layer)(x)
        monkeypatch.setattr(delta_rule, "sequence", without_b)
        assert not torch.allclose(layer(x, None, None, None), want, atol=1e-3)


def test_a_hybrid_trains_and_qwen3_5_holds_it_trained(tmp_path: Path) -> None:
    """Gradients reach every parameter (the decay's and step's too) and 40 AdamW steps on one
    repeating batch take the loss down by half; the trained model as Qwen3_5ForCausalLM gives its
    logits within 1e-4 and its greedy tokens, and back through init_from=hf: exactly."""
    torch.manual_seed(0)
    m = tiny_model(
        **(QWEN | dict(n_layer=2, layer_pattern="DL", attn_gate="element", qk_norm=True))
    ).train()
    idx = torch.randint(0, 61, (4, 33), generator=torch.Generator().manual_seed(6))
    x, y = idx[:, :-1], idx[:, 1:]
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    first = None
    for step in range(40):
        _, loss = m(x, y)
        opt.zero_grad()
        loss.backward()
        if step == 0:
            first = loss.item()
            missing = [n for n, p in m.named_parameters() if p.grad is None or not p.grad.any()]
            assert missing == []
        opt.step()
    assert loss.item() < first / 2
    m.eval()
    ours, theirs = exported_logits(m, x)
    assert (ours - theirs).abs().max() < 1e-4
    from smallgpt.hf import to_hf

    prompt = x[:2, :5]
    with torch.no_grad():
        want = generate(m, prompt, 20, temperature=0)
        hf = to_hf(m)
        got = hf.generate(prompt, max_new_tokens=20, do_sample=False, attention_mask=None)
        assert torch.equal(got, want)
        hf.save_pretrained(tmp_path)
        back = load_run(parse_source(f"hf:{tmp_path}"), tokenizer=False).model.eval()
        assert torch.equal(back(x, y)[0], m(x, y)[0])


@pytest.mark.parametrize(
    "overrides",
    [
        dict(n_layer=4, layer_pattern="DDDL", n_kv_head=2, rope_fraction=0.25),
        dict(n_layer=3, layer_pattern="LD", n_kv_head=1),
        dict(n_layer=2, rope_fraction=0.5),
    ],
    ids=["3:1-gqa-quarter", "ld-mqa", "attention-only"],
)
def test_qwen3_5_computes_our_logits_on_random_weights(overrides: dict) -> None:
    """Several shapes, their norms' weights drawn too (Qwen3.5 scales by 1 + w): within 1e-4."""
    attention = dict(attn_gate="element", qk_norm=True)
    torch.manual_seed(1)
    m = lively(tiny_model(**(QWEN | attention | overrides)))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight") or ".ln_" in name:
                p.uniform_(0.5, 1.5)
    idx = torch.randint(0, 61, (2, 32), generator=torch.Generator().manual_seed(7))
    ours, theirs = exported_logits(m, idx)
    assert (ours - theirs).abs().max() < 1e-4 and ours.std() > 0.1


@pytest.mark.parametrize(
    ("overrides", "needs"),
    [
        (dict(layer_pattern="D"), "an attention layer"),
        (dict(layer_pattern="DL", qk_norm=True), "attn_gate='element'"),
        (dict(layer_pattern="DL", attn_gate="head", qk_norm=True), "attn_gate='element'"),
        (dict(layer_pattern="DL", attn_gate="element"), "qk_norm=True"),
        (dict(layer_pattern="DSL", window=8, n_layer=3), "no local layers (window)"),
        (dict(layer_pattern="DL", kv_lora_rank=8), "no MLA"),
        (dict(layer_pattern="DL", bias=True), "bias=False"),
    ],
)
def test_what_qwen3_5_cannot_hold_is_refused_before_anything_is_written(
    overrides: dict, needs: str, tmp_path: Path
) -> None:
    """export.py on such a run: one line naming the key, exit 2 (a user error), no folder."""
    from conftest import cli
    from smallgpt.checkpoint import save_checkpoint

    m = tiny_model(**(QWEN | overrides))
    chars = [chr(ord("a") + i % 26) + str(i) for i in range(61)]
    meta = {"tokenizer": "char", "vocab_size": 61, "chars": chars}
    save_checkpoint(tmp_path / "ckpt.pt", m, iter_num=0, data_meta=meta, config={})
    r = cli(["export.py", f"--out_dir={tmp_path}", f"--to={tmp_path / 'hf'}"])
    assert r.returncode == 2 and needs in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    "name",
    [
        "gqa2-dddl",
        "mha-dsl8",
        "mqa-ddl-gate-qknorm",
        "mha-gate",
        "mha-headgate-rope25",
        "mla8-dl",
        "mha-sssl8-gate-sink",
        "mla8-kkkl-nope",
        "gqa2-sl8-rprn",
    ],
)
def test_a_hybrid_variant_name_is_its_model_and_back(name: str) -> None:
    """compare.py's names for hybrids, Qwen3.5's attention options, sinks and layers without
    positions: parsed, made of an MHA model, named again from that model, and the train.py flags
    that make it: read back as train.py reads them, they give that model."""
    from configurator import given_values
    from smallgpt.sweep import variant_flags
    from smallgpt.variant import Variant

    mha = GPTConfig(n_layer=4, n_head=4, n_embd=32, block_size=32, pos_encoding="rope")
    variant = Variant.parse(name)
    model = variant.config(mha)
    assert str(variant) == name and Variant.from_config(model) == variant
    flags = dict(flag[2:].split("=", 1) for flag in variant_flags(model))
    # as train.py reads its command line
    assert dataclasses.replace(mha, **given_values(GPTConfig, variant_flags(model))) == model
    pattern = name.split("-")[1].rstrip("0123456789")
    if set(pattern) <= set("sldk") and set(pattern) & set("dk"):
        assert flags["layer_pattern"] == pattern.upper() and model.recurrent_layers
    else:
        assert "layer_pattern" not in flags and not model.recurrent_layers
    assert ("attn_gate" in flags) == ("gate" in name)
    assert ("qk_norm" in flags) == ("qknorm" in name)
    assert ("attn_sinks" in flags) == ("sink" in name)
    if "rope25" in name:
        assert flags["rope_fraction"] == "0.25" and model.rope_dim == 2


@pytest.mark.parametrize(
    "name", ["mha-sl", "mha-l", "gqa2-dddl-qknorm-gate", "mha-rope0", "mha-dd-"]
)
def test_a_name_of_no_variant_is_refused(name: str) -> None:
    from smallgpt.variant import Variant

    with pytest.raises(ValueError, match="is not a variant name"):
        Variant.parse(name)


def test_converting_a_hybrid_pools_its_attention_layers_and_refuses_mla() -> None:
    """GQA pooling leaves the Gated DeltaNet layers and the gate as they are (only the attention
    layers' K/V heads change); MLA's conversion, which maps plain attention, is one line."""
    from smallgpt.convert import convert_kv_heads, to_latent
    from smallgpt.errors import UserError

    m = hybrid(n_kv_head=4, layer_pattern="DL", window=None, n_layer=2)
    gqa = convert_kv_heads(m, 2)
    same = {
        k: v for k, v in m.state_dict().items() if ".attn.c_k." not in k and ".attn.c_v." not in k
    }
    assert all(torch.equal(gqa.state_dict()[k], v) for k, v in same.items())
    assert gqa.transformer.h[1].attn.c_k.weight.shape == (16, 32)
    with pytest.raises(UserError, match="MLA conversion maps plain attention layers") as e:
        to_latent(m, 16)
    assert "layer_pattern='DL'" in str(e.value) and "qk_norm=True" in str(e.value)


def test_a_row_that_keeps_one_token_starts_its_state_again() -> None:
    """At block_size 3 a row that slides keeps one token (block_size // 2) and nothing before the
    next step: its recurrent state starts from zeros, so the cached tokens are those recomputed
    on each window, for a batch of unequal prompts."""
    m = hybrid(block_size=3, layer_pattern="DL", window=None, n_layer=2)
    idx, pad = left_pad([[5, 9], [7, 1, 30]])
    with torch.no_grad():
        cached = generate(m, idx, 16, temperature=0, pad=pad)
        recomputed = generate(m, idx, 16, temperature=0, pad=pad, use_cache=False)
    assert torch.equal(cached, recomputed) and len(set(cached[:, 3:].flatten().tolist())) >= 4
