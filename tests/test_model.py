import re

import pytest
import torch
import torch.nn.functional as F

from attention import CausalSelfAttention, rope_tables
from conftest import VARIANTS, distinct, lively, static_steps_match, tiny_model
from model import GPT, LAYER_KINDS, GPTConfig
from model_config import pattern_keys
from smallgpt import fast_paths
from smallgpt.generation import generate


@pytest.mark.parametrize(
    ("D", "H", "G"), [(64, 8, 8), (64, 8, 4), (64, 8, 2), (64, 8, 1), (96, 6, 3), (48, 4, 1)]
)
def test_param_counts_and_kv_bytes_follow_the_formulas(D: int, H: int, G: int) -> None:
    L, V, T = 3, 50, 16
    m = GPT(
        GPTConfig(
            block_size=T, vocab_size=V, n_layer=L, n_head=H, n_kv_head=G, n_embd=D, bias=False
        )
    )
    attn = 2 * D * D + 2 * D * D * G // H
    assert m.attention_params_per_layer() == attn
    if G == H:
        assert attn == 4 * D * D
    if G == 1:
        assert attn == 2 * D * D + 2 * D * D // H
    block = attn + 8 * D * D + 2 * D  # attention + MLP (4x) + two LayerNorm weights
    assert m.num_params() == L * block + D + V * D + T * D  # + ln_f + tied wte/lm_head + wpe
    assert m.num_params(non_embedding=True) == L * block + D
    hd = D // H
    for dtype, size in [(torch.float32, 4), (torch.bfloat16, 2)]:
        for batch, seq in [(1, 16), (3, 7)]:
            expected = 2 * L * batch * G * seq * hd * size
            assert m.config.kv_cache_bytes(batch, seq, dtype) == expected
            cache = m.make_kv_cache(batch, seq, dtype=dtype)
            assert cache.nbytes == expected
            assert cache.stores[0].k.shape == (L, batch, G, seq, hd)


def test_mqa_cache_is_n_head_times_smaller_than_mha() -> None:
    mha = GPTConfig(n_layer=2, n_head=8, n_embd=64, block_size=32, vocab_size=10)
    mqa = GPTConfig(n_layer=2, n_head=8, n_kv_head=1, n_embd=64, block_size=32, vocab_size=10)
    assert mha.kv_cache_bytes(2, 32) == 8 * mqa.kv_cache_bytes(2, 32)


@pytest.mark.parametrize(("n_kv_head", "kind"), [(None, "MHA"), (4, "MHA"), (2, "GQA"), (1, "MQA")])
def test_attention_kind(n_kv_head: int | None, kind: str) -> None:
    cfg = GPTConfig(n_head=4, n_kv_head=n_kv_head, n_embd=32)
    assert cfg.n_kv_head == (n_kv_head or 4)
    assert cfg.attention_type == kind


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (dict(n_head=6, n_kv_head=4, n_embd=48), ["n_head=6", "n_kv_head=4"]),
        (dict(n_head=4, n_kv_head=8), ["n_kv_head=8"]),
        (dict(n_kv_head=0), ["n_kv_head=0"]),
        (dict(n_embd=100, n_head=12), ["n_embd=100", "n_head=12"]),
        (dict(block_size=0), ["block_size=0"]),
        (dict(vocab_size=-5), ["vocab_size=-5"]),
        (dict(n_layer=2.5), ["n_layer=2.5"]),
        (dict(dropout=1.5), ["dropout=1.5"]),
        (dict(pos_encoding="alibi"), ["pos_encoding='alibi'", "learned", "rope"]),
        (dict(pos_encoding="rope", n_embd=36, n_head=12), ["head_dim=3"]),
        (dict(rope_theta=0), ["rope_theta=0"]),
    ],
)
def test_invalid_config_raises_one_clear_error(overrides: dict, names: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        GPTConfig(**overrides)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("invalid GPTConfig")
    for name in names:
        assert name in msg


def test_the_layer_plan_is_each_layer_by_hand_and_its_keys_give_it_back() -> None:
    """GPTConfig.layers over 5 layers from layer_pattern 'SSD' (the last layer's S gives way to
    global attention) and rope_pattern 'RN' (tiled: N on layers 1 and 4), written out by hand;
    then model_config.pattern_keys, its inverse, gives keys that build the same plan, for this
    model and others (window_pattern's S and L, none but global, KDA with no positions)."""
    shape = dict(n_layer=5, n_head=4, n_embd=32, pos_encoding="rope")
    c = GPTConfig(**shape, layer_pattern="SSD", window=8, rope_pattern="RNRRN")
    S, L, D = LAYER_KINDS["S"], LAYER_KINDS["L"], LAYER_KINDS["D"]
    by_hand = [(S, 8, True), (S, 8, False), (D, None, True), (S, 8, True), (L, None, False)]
    assert [(x.kind, x.window, x.rotary) for x in c.layers] == by_hand
    assert c.layer_letters == "SSDSL" and c.positionless_layers == [1, 4]
    others = [
        c,
        GPTConfig(**shape, window_pattern="SSL", window=4),
        GPTConfig(**shape),
        GPTConfig(**shape, layer_pattern="KKL", kv_lora_rank=8, rope_pattern="N"),
    ]
    for config in others:
        keys = pattern_keys(config.layer_letters, [x.rotary for x in config.layers])
        again = GPTConfig(**shape, window=config.window, kv_lora_rank=config.kv_lora_rank, **keys)
        assert again.layers == config.layers, (config.layers, keys)


@pytest.mark.parametrize("pos_encoding", ["learned", "rope"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_causality(variant: str, pos_encoding: str) -> None:
    m = tiny_model(VARIANTS[variant], pos_encoding)
    idx = torch.randint(0, 61, (2, 20))
    logits, _ = m(idx, targets=idx)
    changed = idx.clone()
    changed[:, 12:] = (changed[:, 12:] + 7) % 61
    logits2, _ = m(changed, targets=changed)
    torch.testing.assert_close(logits[:, :12], logits2[:, :12], rtol=0, atol=1e-6)
    assert (logits[:, 12:] - logits2[:, 12:]).abs().max() > 1e-3


@pytest.mark.parametrize("pos_encoding", ["learned", "rope"])
@pytest.mark.parametrize("n_kv_head", [2, 1])
def test_gqa_equals_mha_with_kv_heads_copied_within_groups(
    n_kv_head: int, pos_encoding: str
) -> None:
    gqa = tiny_model(n_kv_head, pos_encoding)
    mha = tiny_model(4, pos_encoding)
    rep, hd = 4 // n_kv_head, gqa.config.head_dim
    state = gqa.state_dict()
    for name, t in list(state.items()):
        if re.search(
            r"attn\.c_[kv]\.(weight|bias)$", name
        ):  # (n_kv_head * hd, ...) -> (n_head * hd, ...)
            state[name] = (
                t.view(n_kv_head, hd, *t.shape[1:])
                .repeat_interleave(rep, dim=0)
                .reshape(4 * hd, *t.shape[1:])
            )
    mha.load_state_dict(state)
    idx = torch.randint(0, 61, (3, 24))
    a, _ = gqa(idx, targets=idx)
    b, _ = mha(idx, targets=idx)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("mask", [False, True])
def test_gqa_attention_equals_explicit_repeat_reference(mask: bool, T: int) -> None:
    """fast_paths.sdpa with 2 K/V heads for 8 query heads (enable_gqa, or one query per head
    under a mask)."""
    q, k, v = torch.randn(2, 8, T, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    m = torch.rand(2, 1, T, 9) > 0.3 if mask else None
    if m is not None:
        m[..., 0] = True
    elif T > 1:
        # no mask means causal, aligned bottom-right as after a cache: here, with 9 keys, only
        # Tq == Tk is
        k, v = k[:, :, :T], v[:, :, :T]
    k_rep, v_rep = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
    scores = q @ k_rep.transpose(-1, -2) / 4.0
    if m is None and T > 1:
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    ref = (
        torch.softmax(
            scores.masked_fill(m.logical_not(), float("-inf")) if m is not None else scores, -1
        )
        @ v_rep
    )
    torch.testing.assert_close(
        fast_paths.sdpa(q, k, v, m, dropout_p=0.0, cached=False), ref, rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("case", ["causal", "mask", "decode"])
@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
def test_matmul_attention_equals_sdpa(case: str, n_kv_head: int) -> None:
    """The plain-matmul attention that bf16 training on CPU takes computes SDPA's function, values
    and gradients."""
    T, Tk = (6, 6) if case == "causal" else (6, 9) if case == "mask" else (1, 9)
    q = torch.randn(2, 4, T, 16, requires_grad=True)
    k, v = (torch.randn(2, n_kv_head, Tk, 16, requires_grad=True) for _ in range(2))
    m = None
    if case == "mask":
        m = torch.rand(2, 1, T, Tk) > 0.3
        m[..., 0] = True
    ref_k, ref_v = (t.repeat_interleave(4 // n_kv_head, dim=1) for t in (k, v))
    ref = F.scaled_dot_product_attention(q, ref_k, ref_v, attn_mask=m, is_causal=case == "causal")
    out = fast_paths.matmul_attention(q, k, v, m, dropout_p=0.0)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    with torch.autocast(
        "cpu", dtype=torch.bfloat16
    ):  # the path sdpa() takes in bf16 training on CPU
        low = fast_paths.sdpa(q.bfloat16(), k.bfloat16(), v.bfloat16(), m, 0.0, cached=False)
    torch.testing.assert_close(low.float(), ref, rtol=0, atol=0.05)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
def test_training_attention_equals_each_projection_rotated_by_hand(
    n_kv_head: int, bias: bool
) -> None:
    """Without a cache, q, k and v come from one product and q and k are rotated as one
    (fast_paths.joint_linear): against each Linear on its own and RoPE written as complex products,
    values and the weights' gradients."""
    torch.manual_seed(0)
    B, T, H, hd = 2, 7, 4, 8
    config = GPTConfig(n_layer=1, n_head=H, n_kv_head=n_kv_head, n_embd=H * hd, bias=bias)
    attn = CausalSelfAttention(config, 0)
    x = torch.randn(B, T, H * hd)
    cos, sin = rope_tables(hd, T, 10000.0)
    out = attn(x, (cos[None, None], sin[None, None]), None, None)

    def heads(linear: torch.nn.Linear, n: int, rotate: bool) -> torch.Tensor:
        y = linear(x).view(B, T, n, hd).transpose(1, 2)
        if not rotate:
            return y.repeat_interleave(H // n, dim=1)
        z = torch.complex(*y.chunk(2, dim=-1)) * torch.complex(
            cos, sin
        )  # each feature pair turned by its angle
        return torch.cat((z.real, z.imag), dim=-1).repeat_interleave(H // n, dim=1)

    q, k, v = (
        heads(attn.c_q, H, True),
        heads(attn.c_k, n_kv_head, True),
        heads(attn.c_v, n_kv_head, False),
    )
    ref = attn.c_proj(
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
        .transpose(1, 2)
        .reshape(B, T, H * hd)
    )
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    weights = list(attn.parameters())
    g = torch.randn_like(ref)
    for a, b in zip(
        torch.autograd.grad(out, weights, g), torch.autograd.grad(ref, weights, g), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def bf16_cache_cases() -> list[tuple[torch.Tensor, ...]]:
    """One query of 4 heads over a cache of 37 positions with 4, 2 and 1 K/V heads: each case's
    fp32 q, k, v and SDPA's output over K/V repeated to the query heads."""
    cases = []
    for n_kv_head in (4, 2, 1):
        q = torch.randn(2, 4, 1, 16)
        k, v = (torch.randn(2, n_kv_head, 37, 16) for _ in range(2))
        ref_k, ref_v = (t.repeat_interleave(4 // n_kv_head, dim=1) for t in (k, v))
        cases.append((q, k, v, F.scaled_dot_product_attention(q, ref_k, ref_v)))
    return cases


def test_one_query_attention_over_a_bf16_cache_equals_sdpa() -> None:
    """Decoding in bf16 on CPU, sdpa() takes one_query_attention: SDPA's function of the fp32
    values to bf16 rounding (fp32 products), each K/V head serving its queries."""
    for q, k, v, ref in bf16_cache_cases():
        low = [t.bfloat16() for t in (q, k, v)]
        with torch.inference_mode():
            out = fast_paths.sdpa(*low, None, 0.0, cached=True)
            direct = fast_paths.one_query_attention(*low)
        assert out.dtype == torch.bfloat16 and out.shape == ref.shape
        torch.testing.assert_close(out.float(), ref, rtol=0, atol=0.05)
        assert torch.equal(out, direct)  # the path sdpa() takes, not SDPA's


def test_compiled_one_query_attention_over_a_bf16_cache_equals_sdpa() -> None:
    """The same compiled (bf16 products): SDPA's output to bf16 rounding for each K/V head count.
    The three cases are one compiled function (one compile, not three; the eager cases were one
    parametrized test with these until they were merged)."""
    cases = bf16_cache_cases()

    def each(*lows: torch.Tensor) -> list[torch.Tensor]:
        return [
            fast_paths.sdpa(*lows[i : i + 3], None, 0.0, cached=True)
            for i in range(0, len(lows), 3)
        ]

    lows = [t.bfloat16() for q, k, v, _ in cases for t in (q, k, v)]
    with torch.inference_mode():
        outs = torch.compile(each, fullgraph=True)(*lows)
    for out, (*_, ref) in zip(outs, cases, strict=True):
        assert out.dtype == torch.bfloat16 and out.shape == ref.shape
        torch.testing.assert_close(out.float(), ref, rtol=0, atol=0.05)


@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
def test_one_query_attention_under_a_mask_equals_sdpa(n_kv_head: int) -> None:
    """CUDA's one-token step (cached, masked: a padded batch, a local layer's ring, the graph's
    whole cache) takes one_query_attention with the mask: SDPA's output in fp32, each row's hidden
    keys left out."""
    q = torch.randn(3, 4, 1, 16)
    k, v = (torch.randn(3, n_kv_head, 37, 16) for _ in range(2))
    mask = torch.rand(3, 1, 1, 37) < 0.6
    mask[..., 5] = True  # no row without a key
    ref = F.scaled_dot_product_attention(
        q, *(t.repeat_interleave(4 // n_kv_head, dim=1) for t in (k, v)), attn_mask=mask
    )
    torch.testing.assert_close(
        fast_paths.one_query_attention(q, k, v, None, mask), ref, rtol=1e-5, atol=1e-6
    )
    assert not torch.allclose(
        fast_paths.one_query_attention(q, k, v), ref, atol=1e-3
    )  # the mask matters


@pytest.mark.parametrize("copy", [False, True])
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_split_across_threads_equals_plain_linear(
    monkeypatch: pytest.MonkeyPatch, threads: int, bias: bool, copy: bool
) -> None:
    """The decoding path of fast_paths.Linear (few rows, no autograd) computes the same product as
    nn.Linear, also when out_features is not a multiple of the thread count, with the weight's views
    or its (in, out) copy (padded with zero features to a multiple of the thread count); with
    autograd it is nn.Linear's own path."""
    monkeypatch.setattr(fast_paths, "SPLIT_COPY_BYTES", 0 if copy else 2**40)
    monkeypatch.setattr(fast_paths, "SPLIT_COPY_WIDE", copy)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for out_features in (48, 50):
            layer = fast_paths.Linear(32, out_features, bias=bias)
            for shape in ((1, 1, 32), (3, 2, 32), (fast_paths.SPLIT_MAX_ROWS, 32), (100, 32)):
                x = torch.randn(shape)
                with torch.no_grad():
                    torch.testing.assert_close(
                        layer(x),
                        torch.nn.functional.linear(x, layer.weight, layer.bias),
                        rtol=1e-5,
                        atol=1e-6,
                    )
                layer(x).sum().backward()
                assert layer.weight.grad is not None
            with (
                torch.no_grad()
            ):  # the cached views follow the weights: updated in place, or replaced
                layer.weight.mul_(2.0)
                torch.testing.assert_close(
                    layer(x[:1]), torch.nn.functional.linear(x[:1], layer.weight, layer.bias)
                )
                layer.weight.data = torch.randn(out_features, 32)
                torch.testing.assert_close(
                    layer(x[:1]), torch.nn.functional.linear(x[:1], layer.weight, layer.bias)
                )
            with (
                torch.inference_mode()
            ):  # a layer made here has inference tensors, which have no version counter
                made = fast_paths.Linear(32, out_features, bias=bias)
                torch.testing.assert_close(
                    made(x[:1]), torch.nn.functional.linear(x[:1], made.weight, made.bias)
                )
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("pos_encoding", ["learned", "rope"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_overfits_one_batch(variant: str, pos_encoding: str) -> None:
    m = tiny_model(VARIANTS[variant], pos_encoding).train()
    opt = m.configure_optimizers(
        weight_decay=0.0, learning_rate=1e-2, betas=(0.9, 0.95), device_type="cpu"
    )
    x = torch.randint(0, 61, (4, 32))
    y = torch.roll(x, -1, dims=1)
    _, first = m(x, targets=y)
    for _ in range(150):
        _, loss = m(x, targets=y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    assert first.item() > 3.5  # about ln(61) = 4.1 at initialisation
    assert loss.item() < 0.2 * first.item()


def test_forward_without_targets_returns_last_position_only() -> None:
    m = tiny_model(2)
    idx = torch.randint(0, 61, (2, 10))
    last, loss = m(idx)
    full, _ = m(idx, targets=idx)
    assert loss is None and last.shape == (2, 1, 61)
    torch.testing.assert_close(last[:, 0], full[:, -1], rtol=0, atol=1e-6)


def test_too_long_input_is_a_clear_error() -> None:
    m = tiny_model(2)
    with pytest.raises(ValueError, match="longer than block_size=32"):
        m(torch.zeros(1, 33, dtype=torch.long))


def test_gpt2_init_and_tied_head() -> None:
    m = tiny_model(2, n_layer=8, n_embd=256, n_head=4)
    assert m.lm_head.weight is m.transformer.wte.weight
    assert abs(m.transformer.h[0].mlp.c_fc.weight.std().item() - 0.02) < 2e-3
    assert (
        abs(m.transformer.h[0].attn.c_proj.weight.std().item() - 0.02 / 4) < 1e-3
    )  # 1/sqrt(2 * 8)
    assert m.transformer.h[0].attn.c_q.bias.abs().sum() == 0


def test_optimizer_decays_matrices_only() -> None:
    m = tiny_model(2)
    opt = m.configure_optimizers(
        weight_decay=0.1, learning_rate=1e-3, betas=(0.9, 0.95), device_type="cpu"
    )
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.dim() == 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() == 1 for p in no_decay["params"])
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == m.num_params()


@pytest.mark.parametrize("G", [4, 2, 1])
def test_flops_per_token_counts_smaller_kv_projections(G: int) -> None:
    D, H, L, V, T = 32, 4, 2, 61, 32
    m = tiny_model(G)
    matmul = L * (2 * D * D + 2 * D * D * G // H + 8 * D * D) + V * D
    assert m.flops_per_token() == 6 * matmul + 12 * L * D * T
    assert m.estimate_mfu(tokens_per_iter=1000, dt=1.0, peak_flops=1e9) == pytest.approx(
        m.flops_per_token() * 1e-6
    )


@pytest.mark.parametrize("pos_encoding", ["learned", "rope"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_training_forward_compiles_without_graph_breaks(variant: str, pos_encoding: str) -> None:
    m = tiny_model(VARIANTS[variant], pos_encoding).train()
    idx = torch.randint(0, 61, (2, 32))
    explanation = torch._dynamo.explain(m)(idx, idx)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("pos_encoding", ["learned", "rope"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_static_decode_step_equals_the_cached_forward(variant: str, pos_encoding: str) -> None:
    """decode_static (fixed shapes: K/V written at a tensor position, the whole cache read under a
    mask), which CUDA graphs replay, and its form over the filled length (the compiled CPU step's)
    give the logits of GPT.forward's one-token step and write the same cache."""
    ref, static, filled = static_steps_match(
        tiny_model(VARIANTS[variant], pos_encoding), range(5, 7), 20
    )
    for cache in (static, filled):
        torch.testing.assert_close(cache.stores[0].k[..., :7, :], ref.stores[0].k[..., :7, :])
        torch.testing.assert_close(cache.stores[0].v[..., :7, :], ref.stores[0].v[..., :7, :])
        assert not cache.stores[0].k[..., 7:, :].any()


def test_generate_slides_its_window_reusing_the_cache() -> None:
    """Past block_size the window slides and refills the same cache; the tokens match
    recomputation's, for a lively model whose tokens follow its window (a random one repeats a token
    whatever it sees)."""
    model = lively(tiny_model(2, "rope", block_size=8))
    idx = torch.randint(
        0, 61, (4, 3)
    )  # rows of equal length: every row slides at once, one prefill for all
    cached = generate(model, idx, 20, temperature=0)
    assert torch.equal(cached, generate(model, idx, 20, temperature=0, use_cache=False))
    assert (
        distinct(cached[:, 9:]) >= 8
    )  # decoded from slid windows (from 9 tokens on), not a token a row repeated
