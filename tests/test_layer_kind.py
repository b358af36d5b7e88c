"""A kind of layer is a file and a row (issue 67): a toy kind, written here and registered at run
time with no edit anywhere else, is built from the config, decodes through the cache as it
recomputes (past block_size too), decodes a padded batch as each row alone, runs in the static
one-token step, counts its parameters and cache bytes, and is refused in one line by export and,
where it says so, by the compiled step. A kind that leaves out a declaration is refused when it is
registered, a kind registered at run time by compare.py (whose train.py runs do not know it), and a
checkpoint of a kind this process has not registered says so."""

import re
from collections.abc import Generator
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import attention
from conftest import (
    TINY_TRAIN,
    cached_chunks_match,
    cli,
    lively,
    padded_steps_match,
    static_steps_match,
)
from kv_cache import RowsSpec
from layer_kind import Config, LayerKind, Mixer
from model import GPT, LAYER_KINDS, GPTConfig, register_kind
from smallgpt.checkpoint import load_checkpoint, model_from_checkpoint, save_checkpoint
from smallgpt.errors import UserError
from smallgpt.generation import generate, left_pad
from smallgpt.tokenizer import CharTokenizer


class ScaledAttention(attention.Attention, LayerKind):
    """Global attention whose scores are scaled by a learned scalar a head: each head's queries
    times exp(head_scale[h]), so that a head may sharpen or soften what it attends to."""

    letter = "Q"
    name = "scaled attention"
    attends = True
    reads = attention.READS - {"kv_lora_rank", "qk_rope_head_dim", "q_lora_rank", "latent_norm"}
    adamw_matrices = ("c_proj",)  # under optimizer='muon', AdamW takes its output projection

    def __init__(self, config: Config, layer: int) -> None:
        super().__init__(config, layer, window=None)
        self.dropout = config.dropout
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.head_dim
        kv_dim = self.n_kv_head * self.head_dim
        self.c_q = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_k = nn.Linear(config.n_embd, kv_dim, bias=config.bias)
        self.c_v = nn.Linear(config.n_embd, kv_dim, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.head_scale = nn.Parameter(torch.empty(self.n_head))

    def initial(self, name: str, generator: torch.Generator | None) -> torch.Tensor | None:
        # every head's scores as plain attention's at the start
        return torch.zeros(self.n_head) if name == "head_scale" else None

    def forward(
        self, x: torch.Tensor, rope: object, mask: object, kv_cache: object
    ) -> torch.Tensor:
        B, T, C = x.shape
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        rope = rope if self.rotary else None  # rope_pattern's N: no positions
        q = attention.rotate(q, rope) * self.head_scale.exp()[:, None, None]
        k = attention.rotate(k, rope)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer, k, v)
        y = self.attend(q, k, v, mask, cached=kv_cache is not None)  # with sinks where set
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))

    @classmethod
    def problems(cls, config: Config) -> list[str]:
        if config.kv_lora_rank is not None and "Q" in config.layer_letters:
            return ["kv_lora_rank: scaled attention has no latent"]
        return []

    @classmethod
    def cache_spec(cls, config: Config) -> RowsSpec:
        return RowsSpec(config.n_kv_head, config.head_dim, config.head_dim)


class Unstatic(ScaledAttention):
    """The same kind, declaring that the fixed-shape step cannot run it."""

    letter = "U"
    name = "unstatic attention"
    static_step = "its scale is read on the host"


@pytest.fixture
def toy_kinds() -> Generator[None, None, None]:
    register_kind(ScaledAttention)
    register_kind(Unstatic)
    yield
    del LAYER_KINDS["Q"]
    del LAYER_KINDS["U"]


def toy(pattern: str = "QLQ", **overrides: object) -> GPT:
    """A lively 3-layer GQA model of the toy kind and global attention, its head scales apart."""
    torch.manual_seed(0)
    config = dict(
        n_layer=3,
        n_head=4,
        n_kv_head=2,
        n_embd=32,
        block_size=32,
        vocab_size=61,
        pos_encoding="rope",
        layer_pattern=pattern,
    )
    m = lively(GPT(GPTConfig(**(config | overrides))).eval())
    with torch.no_grad():
        for block in m.transformer.h:
            if isinstance(block.attn, ScaledAttention):
                block.attn.head_scale.copy_(torch.tensor([-1.0, -0.3, 0.4, 1.0]))
    return m


def test_a_kind_registered_at_run_time_decodes_as_it_recomputes(toy_kinds: None) -> None:
    m = toy()
    assert [type(b.attn) for b in m.transformer.h] == [
        ScaledAttention,
        attention.CausalSelfAttention,
        ScaledAttention,
    ]
    assert "scaled attention layers [0, 2] of 3" in m.config.describe()
    with torch.no_grad():
        idx = cached_chunks_match(m, atol=2e-5)
        padded_steps_match(m, atol=2e-5)
        static_steps_match(m, range(5, 12), 16)
        # its scale is felt: the same weights without it give other logits
        scaled = m(idx)[0]
        for block in m.transformer.h:
            if isinstance(block.attn, ScaledAttention):
                block.attn.head_scale.zero_()
        assert not torch.allclose(m(idx)[0], scaled, atol=1e-2)


def test_greedy_decoding_past_block_size_equals_recomputation(toy_kinds: None) -> None:
    """48 new tokens of a 32-token block for prompts of 10 and 3 tokens: the rows slide at other
    steps (a row's cache refilled, the batch's shifted), and the cached stream is the recomputed
    one."""
    m = toy()
    rows = [torch.randint(0, 61, (n,), generator=torch.Generator().manual_seed(n)) for n in (10, 3)]
    idx, pad = left_pad([r.tolist() for r in rows])
    with torch.no_grad():
        cached = generate(m, idx, 48, temperature=0, pad=pad)
        recomputed = generate(m, idx, 48, temperature=0, pad=pad, use_cache=False)
    assert torch.equal(cached, recomputed)
    assert len(set(cached[:, 10:].flatten().tolist())) > 5  # not one token repeated


def test_its_parameters_and_cache_bytes_are_counted_by_hand(toy_kinds: None) -> None:
    m = toy()
    C, G, hd, L, V = 32, 2, 8, 3, 61
    attention_params = (C * C + C) * 2 + (C * G * hd + G * hd) * 2  # q, proj; k, v
    block = attention_params + 2 * C + 2 * (C * 4 * C) + 4 * C + C + 2 * C  # norms, MLP
    scales = 4 * 2  # a scalar a head in the two toy layers
    assert m.num_params() == V * C + L * block + scales + 2 * C
    # K and V of 2 heads of 8 at each of 20 positions in each of the 3 layers, fp32
    assert m.config.kv_cache_bytes(2, 20) == 2 * 3 * 20 * 2 * 2 * 8 * 4
    assert m.make_kv_cache(2, 20).nbytes == m.config.kv_cache_bytes(2, 20)
    # Muon takes the blocks' matrices but the toy's c_proj, which AdamW takes
    from smallgpt.optim import make_optimizer

    muon, adamw = make_optimizer(m, "muon", 0.1, 1e-3, (0.9, 0.95), "cpu", 0.02).optimizers
    muon_ids = {id(p) for group in muon.param_groups for p in group["params"]}
    toy_proj = m.transformer.h[0].attn.c_proj.weight
    assert id(toy_proj) not in muon_ids and id(m.transformer.h[1].attn.c_proj.weight) in muon_ids
    assert len(muon_ids) == 3 * 6 - 2  # q, k, v, proj, fc, mlp proj a block, but two toy projs


def test_export_and_the_compiled_step_refuse_it_in_one_line(toy_kinds: None) -> None:
    from smallgpt.generation import fast_step
    from smallgpt.hf import to_hf

    m = toy()
    with pytest.raises(UserError, match=r"no transformers class holds scaled attention") as e:
        to_hf(m)
    assert "\n" not in str(e.value)
    unstatic = toy("ULU")
    cache = unstatic.make_kv_cache(1, 16)
    with pytest.raises(UserError, match="cannot run unstatic attention layers") as e:
        fast_step(unstatic, cache, cuda_graph=True, compile_step=True)
    assert "its scale is read on the host" in str(e.value) and "\n" not in str(e.value)
    # the CUDA graph (asked by default) gives way to the eager step, without a word
    assert fast_step(unstatic, cache, cuda_graph=True, compile_step=False) is None
    # its own check of the config, and its letter kept its own
    with pytest.raises(ValueError, match="scaled attention has no latent"):
        toy(kv_lora_rank=8)
    with pytest.raises(ValueError, match="letter 'Q' is scaled attention's already"):
        register_kind(type("Other", (ScaledAttention,), {}))


class Uncached(LayerKind):
    """A kind whose layers are scaled attention's, declaring all but what they keep in the cache:
    it would train, and fail only when a model of it samples."""

    letter = "V"
    name = "uncached attention"
    attends = True
    reads = ScaledAttention.reads

    @classmethod
    def build(cls, config: Config, layer: int) -> Mixer:
        return ScaledAttention(config, layer)


class Maskless(Mixer, LayerKind):
    """A kind that is its own mixer, with a forward and a cache but no mask, for the prefill or
    for the static step."""

    letter = "W"
    name = "maskless mixer"

    def __init__(self, config: Config, layer: int) -> None:
        super().__init__(layer)

    def forward(
        self, x: torch.Tensor, rope: object, mask: object, kv_cache: object
    ) -> torch.Tensor:
        return x

    @classmethod
    def cache_spec(cls, config: Config) -> RowsSpec:
        return RowsSpec(config.n_kv_head, config.head_dim, config.head_dim)


class Nameless(Uncached):
    """A kind without a name for messages, whose attends is a word, not a bool."""

    letter = "X"
    name = None  # type: ignore[assignment]
    attends = "yes"  # type: ignore[assignment]

    @classmethod
    def cache_spec(cls, config: Config) -> RowsSpec:
        return RowsSpec(config.n_kv_head, config.head_dim, config.head_dim)


@pytest.mark.parametrize(
    ("kind", "missing"),
    [
        (Uncached, "leaves out cache_spec"),
        (Maskless, "leaves out mask"),
        (Nameless, "has name=None, not a str; has attends='yes', not a bool"),
    ],
)
def test_a_kind_that_leaves_out_a_declaration_is_refused_when_registered(
    toy_kinds: None, kind: type[LayerKind], missing: str
) -> None:
    """Its first model would train, and the declaration be missed only when it samples or exports:
    register_kind says what it lacks, in one line; every kind of the table has it all."""
    try:
        refusal = re.escape(f"{missing}: declare what it lacks")
        with pytest.raises(ValueError, match=refusal) as e:
            register_kind(kind)
        assert f"layer kind {kind.__name__} ({kind.letter!r})" in str(e.value)
        assert "\n" not in str(e.value)
    finally:  # today's code registers it: the table as the other tests know it
        if LAYER_KINDS.get(kind.letter) is kind:
            del LAYER_KINDS[kind.letter]
    # the built-in kinds and the toys declare it all (registering a kind again changes nothing)
    for registered in list(LAYER_KINDS.values()):
        register_kind(registered)


def test_compare_refuses_a_kind_registered_in_its_process_alone(
    toy_kinds: None, tmp_path: Path
) -> None:
    """compare.py trains each variant by a train.py process of its own, which knows the kinds that
    model.py's import registers and no other: a variant of the toy kind, registered here, is
    refused in one line before any run (it would fail after the others had trained)."""
    r = cli(
        [
            "compare.py",
            f"--dataset={tmp_path / 'data'}",
            f"--out_dir={tmp_path / 'cmp'}",
            *TINY_TRAIN,
            "--variants=[mha,mha-ql]",
        ]
    )
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "mha-ql: layer kind 'Q' (scaled attention) is registered in this process" in r.stderr
    assert "train.py runs in a process of its own, where it is not registered" in r.stderr
    assert "model.py imports" in r.stderr and not (tmp_path / "cmp").exists()


def test_a_checkpoint_of_a_kind_not_registered_names_the_kind(tmp_path: Path) -> None:
    """A checkpoint saved by a process that had registered the toy kind, loaded where it is not:
    sample.py, a resume and model_from_checkpoint name the kind, not a damaged checkpoint."""
    register_kind(ScaledAttention)
    try:
        model = toy("QL", n_layer=2, vocab_size=10)
    finally:
        del LAYER_KINDS["Q"]
    chars = CharTokenizer.from_text("abcdefgh\n")
    save_checkpoint(tmp_path / "ckpt.pt", model, iter_num=0, data_meta=chars.meta())
    cause = "uses layer kind 'Q' (layer_pattern='QL'), which this code does not register"
    with pytest.raises(UserError, match=re.escape(cause)):
        model_from_checkpoint(load_checkpoint(tmp_path / "ckpt.pt"))
    for args in (
        ["sample.py", "--device=cpu", "--max_new_tokens=2"],
        ["train.py", "--device=cpu", "--init_from=resume", "--max_iters=2"],
    ):
        r = cli([*args, f"--out_dir={tmp_path}"])
        assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
        assert cause in r.stderr and "register_kind" in r.stderr, r.stderr
