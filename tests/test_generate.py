import itertools
import re
from pathlib import Path

import pytest
import torch

from conftest import (
    COMPILES,
    COMPILES_2,
    DECODE,
    ROOT,
    VARIANTS,
    allowed,
    distinct,
    lively,
    sharpened,
    template_where_it_can,
    tiny_model,
)

# smallgpt.compiled_step (torch's inductor: 1.5 s a process, then conftest's registration of its
# template choice, 1.4 s) is imported in the tests that use it, not as the workers collect
from smallgpt import fast_paths
from smallgpt.generation import generate, left_pad, sample_logits, stream


@pytest.mark.parametrize("pos_encoding", ["learned", "rope"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_with_and_without_cache_agree_past_block_size(
    variant: str, pos_encoding: str
) -> None:
    """A lively model (its tokens depend on the context: a window off by one changes them) decodes
    the same tokens with the cache as by recomputing each window, through several slides."""
    m = lively(tiny_model(VARIANTS[variant], pos_encoding, block_size=16))
    idx = torch.randint(0, 61, (2, 5))
    cached = generate(
        m, idx, 40, temperature=0
    )  # 45 tokens: the 16-token window slides several times
    recomputed = generate(m, idx, 40, temperature=0, use_cache=False)
    assert cached.shape == (2, 45)
    assert torch.equal(cached, recomputed)
    assert torch.equal(cached[:, :5], idx)
    assert all(
        distinct(row) >= 4 for row in cached[:, 5:]
    )  # not one token repeated, which any window gives


def test_prompt_longer_than_block_size_is_cropped_to_its_last_block() -> None:
    m = tiny_model(2, block_size=16)
    idx = torch.randint(0, 61, (1, 40))
    out = generate(m, idx, 3, temperature=0)
    assert torch.equal(out[:, :40], idx)
    assert torch.equal(out[:, 40:], generate(m, idx[:, -16:], 3, temperature=0)[:, 16:])


@pytest.mark.parametrize("pos_encoding", ["learned", "rope"])
def test_padded_batch_generates_what_each_prompt_does_alone(pos_encoding: str) -> None:
    """A lively model, so that a pad slot seen by a real query would change the tokens."""
    m = lively(tiny_model(2, pos_encoding))
    prompts = [torch.randint(0, 61, (n,)).tolist() for n in (2, 7, 4)]
    idx, pad = left_pad(prompts)
    batch = generate(m, idx, 12, temperature=0, pad=pad)
    for row, p in enumerate(prompts):
        alone = generate(m, torch.tensor([p]), 12, temperature=0)
        assert batch[row, -12:].tolist() == alone[0, -12:].tolist()
        assert distinct(alone[0, -12:]) >= 4


def test_eos_row_emits_only_eos_after_it_and_generation_stops_when_all_rows_have() -> None:
    """eos is chosen as a token row 0 produces greedily (and row 1 never does), so the outcome is
    known in advance."""
    m = tiny_model(2)
    idx = torch.randint(0, 61, (2, 4))
    free = generate(m, idx, 12, temperature=0)[:, 4:].tolist()
    eos = next(
        t for t in free[0][2:] if t not in free[1]
    )  # raises StopIteration (fails) if there is none
    first = free[0].index(eos)
    out = generate(m, idx, 12, temperature=0, eos=eos)[:, 4:].tolist()
    assert out[0] == free[0][:first] + [eos] * (
        12 - first
    )  # before eos: as without it; after: eos only
    assert out[1] == free[1]  # the other row is not affected and generation runs to max_new_tokens
    alone = generate(m, idx[:1], 12, temperature=0, eos=eos)[0, 4:].tolist()
    assert (
        alone == free[0][: first + 1]
    )  # every row (the only one) has emitted eos: generation stops there


def test_same_seed_same_tokens_different_seed_different_tokens() -> None:
    m = tiny_model(2)
    idx = torch.randint(0, 61, (1, 3))
    runs = [
        generate(m, idx, 30, temperature=1.0, generator=torch.Generator().manual_seed(s))
        for s in (7, 7, 8)
    ]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_top_k_1_is_greedy() -> None:
    logits = torch.randn(16, 50)
    assert torch.equal(sample_logits(logits, 1.0, top_k=1), logits.argmax(-1))
    m = tiny_model(2)
    idx = torch.randint(0, 61, (2, 3))
    assert torch.equal(generate(m, idx, 10, top_k=1), generate(m, idx, 10, temperature=0))


def test_top_p_keeps_only_the_nucleus() -> None:
    probs = torch.tensor([[0.5, 0.05, 0.3, 0.1, 0.05]])
    logits = probs.log()
    g = torch.Generator().manual_seed(0)
    drawn = {int(sample_logits(logits, 1.0, top_p=0.75, generator=g)) for _ in range(300)}
    assert drawn == {0, 2}  # 0.5 + 0.3 reaches 0.75; nothing else may be drawn
    drawn = {int(sample_logits(logits, 1.0, top_p=0.85, generator=g)) for _ in range(300)}
    assert drawn == {0, 2, 3}
    assert {int(sample_logits(logits, 1.0, top_p=0.1, generator=g)) for _ in range(50)} == {0}


def test_top_k_restricts_candidates() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0]])
    g = torch.Generator().manual_seed(0)
    assert {int(sample_logits(logits, 2.0, top_k=2, generator=g)) for _ in range(200)} == {0, 2}


def test_stream_yields_each_token_before_computing_the_next() -> None:
    """A stream computes lazily: nothing before the first token is asked for, then one forward pass
    per token."""
    m = tiny_model(1, "rope")
    idx = torch.randint(0, 61, (2, 3))
    calls = []
    hook = m.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape))
    tokens = stream(m, idx, 9, temperature=0)
    assert calls == []
    first = next(tokens)
    assert calls == [(2, 3)]  # the prefill of the prompt, no more
    second = next(tokens)
    assert calls == [(2, 3), (2, 1)]  # one one-token step
    rest = list(tokens)
    hook.remove()
    assert len(calls) == 9 and len(rest) == 7
    assert torch.equal(
        torch.stack([first, second, *rest], dim=1), generate(m, idx, 9, temperature=0)[:, 3:]
    )


def rows_as_by_hand(
    m: torch.nn.Module, lengths: tuple[int, ...] = (15, 3, 20, 9), new: int = 40
) -> list[list[int]]:
    """Greedy tokens of a padded batch of random prompts of these lengths, past block_size, each row
    checked against by_hand's recomputation of its prompt alone; returns the rows' new tokens."""
    prompts = [torch.randint(0, 61, (n,)).tolist() for n in lengths]
    idx, pad = left_pad(prompts)
    batch = generate(m, idx, new, temperature=0, pad=pad)[:, -new:].tolist()
    for row, p in enumerate(prompts):
        assert batch[row] == by_hand(m, p, new), f"row {row} ({len(p)} tokens)"
    return batch


def by_hand(m: torch.nn.Module, prompt: list[int], new: int, use_cache: bool = False) -> list[int]:
    """Greedy decoding written out for the test: the model sees the newest block_size tokens at
    most; when a token would make it block_size + 1, only the newest block_size // 2 are kept
    (recomputed from scratch every step)."""
    bs, tokens = m.config.block_size, list(prompt)
    first = max(0, len(tokens) - bs)
    for _ in range(new):
        if len(tokens) - first > bs:
            first = len(tokens) - bs // 2
        logits, _ = m(torch.tensor([tokens[first:]]))
        tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt) :]


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("pos_encoding", ["learned", "rope"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_each_row_of_a_padded_batch_equals_its_prompt_alone_far_past_block_size(
    variant: str, pos_encoding: str, use_cache: bool
) -> None:
    """Rows of unequal length (near block_size, short, cropped, ...) each slide their own window, so
    every row gets what its prompt gets alone, for 3+ times block_size new tokens; alone == the
    by-hand recomputation, in every case (a lively model: its tokens follow its window)."""
    m = lively(tiny_model(VARIANTS[variant], pos_encoding, block_size=16))
    prompts = [torch.randint(0, 61, (n,)).tolist() for n in (15, 3, 20, 9, 1, 12)]
    idx, pad = left_pad(prompts)
    new = 50
    batch = generate(m, idx, new, temperature=0, pad=pad, use_cache=use_cache)[:, -new:].tolist()
    for row, p in enumerate(prompts):
        alone = generate(m, torch.tensor([p]), new, temperature=0, use_cache=use_cache)[
            0, -new:
        ].tolist()
        assert batch[row] == alone, f"row {row} ({len(p)} tokens)"
        assert alone == by_hand(m, p, new), f"row {row} ({len(p)} tokens)"
    assert (
        distinct(batch) >= 12
    )  # not each row one token repeated (6 at most), which any window would give


def test_a_stream_asked_for_endless_tokens_keeps_bounded_memory() -> None:
    """stream() keeps only what the windows reach (not a buffer of max_new_tokens): 10**12 asked,
    100 taken, the same tokens as generate() of 100, past block_size 16 with rows of a padded batch
    sliding at different steps."""
    m = sharpened(tiny_model(2, "rope", block_size=16))
    idx, pad = left_pad([torch.randint(0, 61, (n,)).tolist() for n in (16, 3)])
    endless = torch.stack(
        list(itertools.islice(stream(m, idx, 10**12, temperature=0, pad=pad), 100)), dim=1
    )
    assert torch.equal(endless, generate(m, idx, 100, temperature=0, pad=pad)[:, -100:])


@pytest.mark.parametrize("block_size", [2, 3, 8])
def test_sliding_rule_at_tiny_block_sizes(block_size: int) -> None:
    """block_size // 2 of 1 (a slide keeps one token, so the refill is empty) and odd sizes."""
    m = sharpened(tiny_model(2, "rope", block_size=block_size))
    prompts = [torch.randint(0, 61, (n,)).tolist() for n in (1, block_size, block_size // 2 + 1)]
    idx, pad = left_pad(prompts)
    batch = generate(m, idx, 4 * block_size + 1, temperature=0, pad=pad)[
        :, -(4 * block_size + 1) :
    ].tolist()
    for row, p in enumerate(prompts):
        assert batch[row] == by_hand(m, p, 4 * block_size + 1)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(temperature=-1.0), "temperature=-1.0 must be >= 0"),
        (dict(top_p=1.5), "top_p=1.5 must be in (0, 1]"),
        (dict(top_p=0.0), "top_p=0.0 must be in (0, 1]"),
        (dict(top_k=0), "top_k=0 must be >= 1"),
    ],
)
def test_meaningless_sampling_settings_are_refused(options: dict, message: str) -> None:
    m = tiny_model(2)
    with pytest.raises(ValueError, match=re.escape(message)):
        generate(m, torch.zeros(1, 2, dtype=torch.long), 3, **options)


@pytest.mark.parametrize(("top_k", "top_p"), [(None, 0.5), (None, 0.9), (10, 0.8), (3, 0.99)])
def test_top_k_and_top_p_through_generate_draw_exactly_the_allowed_tokens(
    top_k: int | None, top_p: float
) -> None:
    """Only allowed tokens are drawn, each about as often as its renormalised probability (400
    draws)."""
    m = tiny_model(2)
    idx = torch.randint(0, 61, (1, 5))
    with torch.no_grad():
        m.lm_head.weight.mul_(
            4.0
        )  # a peakier distribution than the random model's near-uniform one
        logits, _ = m(idx)
    expected = allowed(logits[0, -1] / 0.7, top_k, top_p)
    g = torch.Generator().manual_seed(0)
    drawn = generate(
        m, idx.expand(400, -1), 1, temperature=0.7, top_k=top_k, top_p=top_p, generator=g
    )[:, -1]
    counts = torch.bincount(drawn, minlength=61)
    assert set(drawn.tolist()) <= expected.keys() and len(expected) > 1
    for token, p in expected.items():  # 4 standard deviations of a binomial count
        assert abs(int(counts[token]) - 400 * p) <= 4 * (400 * p * (1 - p)) ** 0.5 + 1, (
            token,
            p,
            int(counts[token]),
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_probes_tell_every_weight_apart(dtype: torch.dtype) -> None:
    """The stand-ins that the compiled step is compiled on (compiled_step.probe) are exact in each
    dtype, and the blocked layouts of any two of the same shape differ, past 128 of them too (the
    first elements repeat)."""
    from smallgpt import compiled_step

    w = torch.zeros(48, 32, dtype=dtype)
    probes = [compiled_step.probe(w, i) for i in range(300)]
    assert all(p.dtype == dtype and p.view(-1)[0] == -1 - i % 128 for i, p in enumerate(probes))
    layouts = {compiled_step.blocked(p, 16, 2).float().numpy().tobytes() for p in probes}
    assert len(layouts) == len(probes)


@COMPILES
def test_the_process_running_the_tests_compiles_with_the_template_untimed() -> None:
    """conftest registers template_where_it_can with inductor in the process that runs a test of
    the compiling groups (a pytest-xdist worker, or pytest itself with -n 0), before the test:
    else every compile here would time each product's choices (docs/testing.md "Compiled decode
    steps")."""
    from torch._inductor import select_algorithm

    selector = select_algorithm.get_algorithm_selector_cache()
    assert template_where_it_can in selector.preprocessing_fns


@pytest.mark.parametrize(
    ("variant", "pos_encoding"),
    [
        pytest.param("MHA", "learned", marks=COMPILES_2),
        pytest.param("GQA", "rope", marks=COMPILES),
        pytest.param("MLA", "rope", marks=COMPILES_2),
    ],
)
def test_compiled_cpu_step_decodes_the_eager_tokens_past_block_size(
    variant: str, pos_encoding: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """compile_step=True (compiled_step.CompiledStep: GPT.decode_static exported and compiled by
    AOTInductor, one step for every cache length) gives the eager logits and tokens, through window
    slides, compiled once, with each way a product runs inside it: MHA as by default at this size
    (every product through inductor's GEMM template, reading blocked copies of the weights), GQA
    without the template (every weight fast_paths.Linear's (in, out) copy padded to the thread
    count: the lm_head's way at GPT-2's size), MLA (the absorbed step over its latent cache, in a
    ring in the local first layer) with the layers' products through the template and the lm_head
    split over views of its weight, its odd row (vocab 101) multiplied apart. A padded batch takes
    the eager step and still matches each prompt."""
    from smallgpt import compiled_step
    from smallgpt.compiled_step import STEPS, CompiledStep

    if (
        variant != "MHA"
    ):  # GQA: no product through the template; MLA: all but the lm_head's (32 x 101 floats)
        monkeypatch.setattr(
            compiled_step, "TEMPLATE_MAX_BYTES", 0 if variant == "GQA" else 32 * 101 * 4 - 1
        )
    monkeypatch.setattr(
        fast_paths, "SPLIT_COPY_BYTES", 0 if variant == "GQA" else fast_paths.SPLIT_COPY_BYTES
    )
    monkeypatch.setattr(fast_paths, "SPLIT_COPY_WIDE", variant != "MLA")
    # MLA: its latent cache, no V, the first layer local (its ring of 5 slots an input of the step
    # too)
    latent = (
        {"kv_lora_rank": 16, "vocab_size": 101, "window": 5, "window_pattern": "S"}
        if variant == "MLA"
        else {}
    )
    m = tiny_model(VARIANTS.get(variant), pos_encoding, **DECODE | latent)
    idx = torch.randint(0, 96, (2, 3))
    with torch.inference_mode():
        for n in (80, 9):  # a second cache length reuses the graph
            eager, compiled = (
                torch.stack(list(stream(m, idx, n, temperature=0, compile_step=c)), 1)
                for c in (0, 1)
            )
            assert torch.equal(compiled, eager)
        cache, ref = m.make_kv_cache(2, 16), m.make_kv_cache(2, 16)
        m(idx, kv_cache=cache), m(idx, kv_cache=ref)
        step = CompiledStep(m, cache)
        for t in range(4):
            torch.testing.assert_close(
                step(idx[:, t % 3 : t % 3 + 1])[0],
                m(idx[:, t % 3 : t % 3 + 1], kv_cache=ref)[0],
                rtol=1e-5,
                atol=1e-5,
            )
        prompts = [[5, 6, 7, 8], [9]]
        p_idx, pad = left_pad(prompts)
        padded = generate(m, p_idx, 6, temperature=0, pad=pad, compile_step=True)
    assert [padded[b, -6:].tolist() for b in range(2)] == [
        generate(m, torch.tensor([p]), 6, temperature=0)[0, -6:].tolist() for p in prompts
    ]
    split = m.lm_head.split  # what the step multiplied (None with one thread: no split)
    if (
        variant == "MLA" and split is not None
    ):  # views, and the rows past a multiple of the thread count apart
        assert (
            split.rest is not None
            and split.weight.size(0) * split.weight.size(2) + split.rest[0].size(0) == 101
        )
    assert len(STEPS[m]) == 1
    ((_, sources, lent),) = STEPS[
        m
    ].values()  # the weights read in blocked copies: those of the template's products
    blocked = {
        id(lent[name][0]) for name, *_ in sources.values()
    }  # (lent as they are under their own names too)
    candidates = {
        id(mod.weight)
        for mod in m.modules()
        if isinstance(mod, fast_paths.Linear)
        and variant != "GQA"
        and (variant == "MHA" or mod is not m.lm_head)
    }  # autotuning may still pick ATen's for a shape
    if variant == "MLA" and split is not None:  # the lm_head's odd row: a small product of its own
        candidates.add(id(split.rest[0]))
    assert blocked <= candidates and bool(blocked) == bool(candidates)


@COMPILES_2
def test_compiled_bf16_step_gives_the_eager_logits_through_blocked_weights() -> None:
    """In bf16 the compiled step's products run inductor's GEMM template too (AMX or AVX512-BF16
    read the weights with pairs of input features together, others as in fp32): each step's logits
    are the eager step's to bf16 rounding, read through blocked copies of the weights in whichever
    layout the template took."""
    from smallgpt.compiled_step import STEPS, CompiledStep

    m = tiny_model(None, "rope", **DECODE).to(torch.bfloat16)
    idx = torch.randint(0, 96, (1, 40))
    cache, ref = m.make_kv_cache(1, 64), m.make_kv_cache(1, 64)
    with torch.inference_mode():
        m(idx[:, :1], kv_cache=cache), m(idx[:, :1], kv_cache=ref)
        step = CompiledStep(m, cache)
        for t in range(1, 40):
            got, want = step(idx[:, t : t + 1])[0], m(idx[:, t : t + 1], kv_cache=ref)[0]
            torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=0.02)
            assert (
                got.argmax() == want.argmax()
                or want[0, 0].float().topk(2).values.diff().abs() < 0.05
            )
    ((_, sources, lent),) = STEPS[m].values()
    assert sources and all(lent[name][0].dtype == torch.bfloat16 for name in sources)
    assert {vnni for *_, vnni in sources.values()} <= {1, 2, 4}


@COMPILES_2
def test_compiled_steps_of_two_models_in_turns_each_decode_their_own_tokens() -> None:
    """Compiled steps are kept per model and batch size, and read the weights lent at each stream:
    two models whose weights have the same shapes (4 and 2 heads over 32 features, so only the head
    count tells their steps apart), and the first again at batch 2, streamed in turns past
    block_size, each decode their eager tokens. (The first is the DECODE model: its batch-1 step is
    bench.py's and sample.py's, its batch-2 step
    test_compiled_cpu_step_decodes_the_eager_tokens_past_block_size's MHA case.)"""
    from smallgpt.compiled_step import STEPS

    models = [tiny_model(None, "learned", **DECODE | {"n_head": h}) for h in (4, 2)]
    runs = [
        (models[0], torch.randint(0, 96, (1, 3))),
        (models[1], torch.randint(0, 96, (1, 3))),
        (models[0], torch.randint(0, 96, (2, 3))),
    ]
    with torch.inference_mode():
        want = [generate(m, p, 70, temperature=0) for m, p in runs]
        streams = [stream(m, p, 70, temperature=0, compile_step=True) for m, p in runs]
        turns = [[] for _ in runs]
        for tokens in zip(*streams):
            for out, t in zip(turns, tokens):
                out.append(t)
    for w, (_, p), out in zip(want, runs, turns):
        assert torch.equal(torch.cat([p, torch.stack(out, 1)], 1), w)
    assert [len(STEPS[m]) for m in models] == [2, 1]


@COMPILES_2
def test_release_steps_removes_the_unpacked_steps_of_models_still_alive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AOTInductor's loader unpacks a compiled step into a folder under TMPDIR and removes it only
    when the loader is destroyed, which the suite's shared models, alive to its end, left undone
    (about 14 folders a run). compiled_step.release_steps, run at exit, lets every loader go while
    its model lives on; the model then loads its step again. The step is the batch-1 DECODE one the
    other tests loading it share, so it is loaded from inductor's cache, not compiled."""
    from smallgpt import compiled_step
    from smallgpt.compiled_step import STEPS

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    m = tiny_model(None, "learned", **DECODE)
    idx = torch.randint(0, 96, (1, 3))
    with torch.inference_mode():
        first = generate(m, idx, 6, temperature=0, compile_step=True)
        assert len(list(tmp_path.glob("aotinductor_*"))) == 1  # unpacked where asked
        compiled_step.release_steps()
        assert not list(tmp_path.glob("aotinductor_*")) and m not in STEPS
        assert torch.equal(generate(m, idx, 6, temperature=0, compile_step=True), first)
    assert len(STEPS[m]) == 1


@COMPILES_2
def test_the_compiled_step_reads_the_weights_as_they_are_at_each_stream() -> None:
    """The compiled step's template products read blocked copies of the weights
    (compiled_step.lend): kept while a weight is unchanged, made again when it changes in place (as
    under an optimizer) or is replaced, so the compiled tokens follow the eager ones after each
    change (and each change does change them). Which products take the template is autotuning's
    choice (timed): the weights changed are two of those that did."""
    from smallgpt.compiled_step import STEPS

    torch.manual_seed(
        0
    )  # the model, the prompt and the new weights: a change of one weight that shows in the tokens
    m = tiny_model(None, "learned", **DECODE)
    idx, before, copies, changed = torch.randint(0, 96, (1, 3)), None, [], []
    for change in ("none", "none", "in place", "replaced"):
        with torch.no_grad():
            if (
                change == "in place"
            ):  # (negating it, as an earlier version did, left the greedy tokens as they were)
                weight = m.get_submodule(changed[0]).weight
                weight.copy_(torch.randn_like(weight) / 4)
            elif change == "replaced":
                layer = m.get_submodule(changed[1])
                layer.weight = torch.nn.Parameter(torch.randn_like(layer.weight) / 4)
        with torch.inference_mode():
            eager, compiled = (
                generate(m, idx, 40, temperature=0, compile_step=c) for c in (False, True)
            )
        assert torch.equal(compiled, eager)
        assert (change == "none") == (before is None or torch.equal(eager, before))
        before = eager
        ((_, sources, lent),) = STEPS[m].values()
        copies.append({name: lent[name][0] for name in sources})
        if (
            not changed
        ):  # two layers' weights that the template reads, one in each block where it can
            blocked = {
                source.removeprefix("model.").removesuffix(".weight")
                for source, *_ in sources.values()
            }
            order = (
                "mlp.c_fc",
                "attn.c_proj",
                "mlp.c_proj",
                "attn.c_v",
                "attn.c_q",
            )  # ones whose change shows
            changed = [
                f"transformer.h.{i}.{w}"
                for w in order
                for i in (0, 1)
                if f"transformer.h.{i}.{w}" in blocked
            ]
            if len(changed) < 2:  # autotuning timed ATen faster for the others
                pytest.skip(
                    f"autotuning put {len(changed)} of these products "
                    "through the GEMM template, not 2"
                )
    assert copies[0] and all(
        copies[1][name] is t for name, t in copies[0].items()
    )  # unchanged: not made again
    for (old, new), module in zip(
        zip(copies[1:], copies[2:]), changed
    ):  # only the changed weight's copy made again
        remade = {sources[name][0] for name, t in old.items() if new[name] is not t}
        assert remade == {f"model.{module}.weight"}


def test_the_compiled_steps_cache_name_is_the_same_in_a_checkout_elsewhere() -> None:
    """The exported program's text names the source files it came from: the package's cache name
    leaves them out, so a clone at another path loads the steps compiled here instead of compiling
    them again; another shape differs."""
    from smallgpt import compiled_step

    def program(n_embd: int) -> str:
        model = tiny_model(n_embd=n_embd)
        return str(torch.export.export(model, (torch.zeros(1, 4, dtype=torch.long),), strict=False))

    here = program(32)
    assert "# File: " in here and str(ROOT) in here
    elsewhere = here.replace(str(ROOT), "/somewhere/else/smallgpt")
    key = compiled_step.package_key
    assert key(elsewhere) == key(here) != key(program(64))
