"""MHA -> MLA conversion (convert.to_latent, MHA2MLA's partial RoPE and joint SVD): exact where it
can be (learned positions at full rank; a rotary model that already is partial-RoPE MHA), the
truncated SVD where it is not, and train.py's --init_from=convert: --kv_lora_rank=R end to end."""

import math
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from conftest import TINY_TRAIN, cli, read_log, run, tiny_model
from model import GPT
from smallgpt.checkpoint import load_checkpoint, model_from_checkpoint
from smallgpt.convert import to_latent
from smallgpt.data import Batches
from smallgpt.errors import UserError
from smallgpt.measure import evaluate

ATOL = 1e-5  # float32: the converted model computes the same scores through other products
H, HD, C = 4, 8, 32  # tiny_model's heads, head_dim, n_embd


def trained_like(m: GPT) -> GPT:
    """The model with sharp attention and logits (queries and keys 20x, the other matrices 5x,
    embeddings 10x) and random biases: its outputs depend on which keys a query sees, so a wrong row
    or scale changes them."""
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif p.dim() == 2:
                big = name.endswith(("c_q.weight", "c_k.weight"))
                p.mul_(20.0 if big else 10.0 if name.startswith("transformer.w") else 5.0)
    return m.eval()


def logits(m: GPT, seed: int = 0) -> torch.Tensor:
    idx = torch.randint(0, 61, (2, 24), generator=torch.Generator().manual_seed(seed))
    return m(idx, targets=idx)[0]


def heads(t: torch.Tensor) -> torch.Tensor:
    return t.view(H, HD, *t.shape[1:])  # (H, head_dim, ...)


def stacked(attn: torch.nn.Module, nope: list[int]) -> torch.Tensor:
    """kv_b's layout by hand: each head's key rows (its NoPE features, then zero rows up to
    head_dim), then its value rows; (2 * n_embd, n_embd)."""
    k, v = heads(attn.c_k.weight), heads(attn.c_v.weight)
    rows = []
    for h in range(H):
        rows += [k[h, nope], torch.zeros(HD - len(nope), C), v[h]]
    return torch.cat(rows)


def truncated(w: torch.Tensor, rank: int) -> torch.Tensor:
    u, s, vh = torch.linalg.svd(w.double(), full_matrices=False)
    return ((u[:, :rank] * s[:rank]) @ vh[:rank]).float()


@pytest.mark.parametrize("bias", [True, False])
def test_learned_positions_at_full_rank_keep_the_logits(bias: bool) -> None:
    m = trained_like(tiny_model(None, "learned", bias=bias))
    c = to_latent(m, C).eval()
    assert (c.config.kv_lora_rank, c.config.qk_rope_head_dim, c.config.latent_norm) == (C, 0, False)
    assert c.config.attention_type == "MLA"
    torch.testing.assert_close(logits(c), logits(m), rtol=0, atol=ATOL)
    old, new = m.state_dict(), c.state_dict()
    for name, t in old.items():
        if ".attn." not in name:
            assert torch.equal(new[name], t), name  # every weight outside attention as it was


@pytest.mark.parametrize("pos_encoding", ["learned", "rope"])
def test_a_lower_rank_is_the_truncated_svd_of_each_heads_keys_and_values(pos_encoding: str) -> None:
    m = trained_like(tiny_model(None, pos_encoding))
    rope_dim = 4 if pos_encoding == "rope" else 0
    c = to_latent(m, 12, rope_dim if rope_dim else None)
    rope = [0, 2, 4, 6] if rope_dim else []  # every second frequency of 4 pairs: (0, 4) and (2, 6)
    nope = [i for i in range(HD) if i not in rope]
    scale = math.sqrt((HD + rope_dim) / HD)
    for old, new in zip(m.transformer.h, c.transformer.h, strict=True):
        kv_a, kv_b = new.attn.kv_a.weight, new.attn.kv_b.weight
        torch.testing.assert_close(
            kv_b @ kv_a[:12], truncated(stacked(old.attn, nope), 12), rtol=0, atol=ATOL
        )
        k, q = heads(old.attn.c_k.weight), heads(old.attn.c_q.weight)
        new_q = new.attn.c_q.weight.view(H, HD + rope_dim, C)
        torch.testing.assert_close(
            kv_a[12:], k[:, rope].mean(0), rtol=0, atol=0
        )  # the heads' rotary keys pooled
        torch.testing.assert_close(
            new_q[:, HD:], scale * q[:, rope], rtol=0, atol=1e-6
        )  # each head's rotary query
        torch.testing.assert_close(new_q[:, : len(nope)], scale * q[:, nope], rtol=0, atol=1e-6)
        assert not new_q[
            :, len(nope) : HD
        ].any()  # the NoPE query's padding meets the key's zero rows
        torch.testing.assert_close(
            new.attn.kv_a.bias[12:], heads(old.attn.c_k.bias)[:, rope].mean(0)
        )
        assert not new.attn.kv_a.bias[:12].any()


def test_a_lower_rank_model_equals_mha_with_the_truncated_keys_and_values() -> None:
    m = trained_like(tiny_model(None, "learned"))
    c = to_latent(m, 12).eval()
    by_hand = trained_like(tiny_model(None, "learned"))
    by_hand.load_state_dict(m.state_dict())
    with torch.no_grad():
        for block in by_hand.transformer.h:
            kv = truncated(stacked(block.attn, list(range(HD))), 12).view(H, 2, HD, C)
            block.attn.c_k.weight.copy_(kv[:, 0].reshape(C, C))
            block.attn.c_v.weight.copy_(kv[:, 1].reshape(C, C))
    assert (logits(m) - logits(by_hand)).abs().max() > 0.1  # rank 12 of 32 is not the MHA model
    torch.testing.assert_close(logits(c), logits(by_hand), rtol=0, atol=ATOL)


@pytest.mark.parametrize("rope_dim", [2, 4, 8])
def test_a_rotary_model_that_already_is_partial_rope_converts_exactly(rope_dim: int) -> None:
    """MHA whose queries have no NoPE features and whose heads share their rotary keys loses nothing
    to partial RoPE or to pooling: at full rank the MLA model is the same function, which checks the
    frequencies kept, their order, the scale correction and the pooled key."""
    m = trained_like(tiny_model(None, "rope"))
    step = HD // rope_dim
    rope = [i for i in range(HD // 2) if i % step == 0]
    rope += [i + HD // 2 for i in rope]
    nope = [i for i in range(HD) if i not in rope]
    with torch.no_grad():
        for block in m.transformer.h:
            for p in (block.attn.c_q.weight, block.attn.c_q.bias):
                heads(p)[:, nope] = 0.0
            for p in (block.attn.c_k.weight, block.attn.c_k.bias):
                heads(p)[:, rope] = heads(p)[:1, rope]  # head 0's rotary key in every head
    c = to_latent(m, C, rope_dim).eval()
    assert c.config.qk_rope_head_dim == rope_dim and c.rope_cos.shape == (32, rope_dim // 2)
    torch.testing.assert_close(logits(c), logits(m), rtol=0, atol=ATOL)


def test_a_rotary_models_loss_after_conversion_is_finite(capsys: pytest.CaptureFixture) -> None:
    m = trained_like(tiny_model(None, "rope"))
    idx = torch.randint(0, 61, (4, 32), generator=torch.Generator().manual_seed(1))
    losses = {"MHA": m(idx, targets=idx)[1].item()}
    for rank, rope_dim in ((32, 4), (16, 4), (16, 2), (8, 4)):
        losses[f"r{rank}-d{rope_dim}"] = (
            to_latent(m, rank, rope_dim).eval()(idx, targets=idx)[1].item()
        )
    with capsys.disabled():
        print(
            "\nloss of a random rotary model, converted:",
            {k: round(v, 4) for k, v in losses.items()},
        )
    assert all(math.isfinite(v) for v in losses.values())


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: to_latent(tiny_model(2), 16),
            "MLA conversion starts from an MHA model, and this one is GQA "
            "(n_head=4, n_kv_head=2): convert the MHA run instead",
        ),
        (
            lambda: to_latent(tiny_model(None, "rope"), 16, 6),
            "qk_rope_head_dim=6 does not divide head_dim=8: MLA's "
            "rotary frequencies are MHA's only for one of [2, 4, 8]",
        ),
        (lambda: to_latent(tiny_model(None), 0), "kv_lora_rank=0 must be a positive integer"),
        (lambda: to_latent(tiny_model(None), 33), "kv_lora_rank=33 exceeds n_embd=32"),
        (
            lambda: to_latent(tiny_model(None, "learned"), 16, 4),
            "qk_rope_head_dim=4 must be a positive integer with "
            "pos_encoding='rope', 0 with 'learned'",
        ),
    ],
)
def test_what_cannot_be_converted_is_one_line(call: object, message: str) -> None:
    with pytest.raises(UserError) as e:
        call()
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.fixture(scope="module")
def mha_run(pycode_small: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny rotary MHA run, 20 iterations."""
    out = tmp_path_factory.mktemp("mha")
    run(
        [
            "train.py",
            f"--dataset={pycode_small}",
            f"--out_dir={out}",
            *TINY_TRAIN,
            "--pos_encoding=rope",
            "--max_iters=20",
            "--eval_interval=20",
            "--always_save_checkpoint=True",
        ]
    )
    return out


def test_a_run_converted_to_mla_starts_from_the_converted_model_trains_and_resumes(
    pycode_small: Path, mha_run: Path, tmp_path: Path
) -> None:
    convert = [
        f"--init_from=convert:{mha_run}",
        "--kv_lora_rank=16",
        "--qk_rope_head_dim=4",
        "--latent_norm=False",
    ]
    run(
        [
            "train.py",
            f"--dataset={pycode_small}",
            f"--out_dir={tmp_path}",
            *TINY_TRAIN,
            *convert,
            "--max_iters=10",
            "--eval_interval=10",
            "--always_save_checkpoint=True",
        ]
    )
    converted = to_latent(model_from_checkpoint(load_checkpoint(mha_run / "ckpt.pt")), 16, 4)
    expected = evaluate(converted, Batches(pycode_small, 32, 8, 1337, "cpu"), 4, nullcontext())
    evals = [r for r in read_log(tmp_path) if r["event"] == "eval"]
    assert [r["iter"] for r in evals] == [0, 10]
    assert abs(evals[0]["val_loss"] - expected["val"]) < 1e-5  # iteration 0 is the converted model
    ckpt = load_checkpoint(tmp_path / "ckpt.pt")
    assert ckpt["iter_num"] == 10 and ckpt["model_config"]["kv_lora_rank"] == 16
    assert ckpt["model_config"]["latent_norm"] is False and ckpt["config"]["latent_norm"] is False
    assert not torch.equal(
        ckpt["model"]["transformer.h.0.attn.kv_b.weight"],
        converted.state_dict()["transformer.h.0.attn.kv_b.weight"],
    )  # it trained
    run(
        [
            "train.py",
            f"--dataset={pycode_small}",
            f"--out_dir={tmp_path}",
            "--init_from=resume",
            "--max_iters=20",
            "--eval_interval=10",
            "--always_save_checkpoint=True",
        ]
    )
    assert load_checkpoint(tmp_path / "ckpt.pt")["iter_num"] == 20
    resumed = [r for r in read_log(tmp_path) if r["event"] == "eval"][2:]
    assert [r["iter"] for r in resumed] == [10, 20] and abs(
        resumed[0]["val_loss"] - evals[1]["val_loss"]
    ) < 1e-6


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--kv_lora_rank=16"],
            "gives a model without the latent's RMSNorm: add --latent_norm=False",
        ),
        (
            ["--kv_lora_rank=16", "--latent_norm=False", "--qk_rope_head_dim=6"],
            "qk_rope_head_dim=6 does not divide",
        ),
        (["--kv_lora_rank=0", "--latent_norm=False"], "kv_lora_rank=0 must be a positive integer"),
        (
            ["--kv_lora_rank=16", "--latent_norm=False", "--convert_method=first"],
            "convert_method='first' pools K/V",
        ),
        (
            ["--kv_lora_rank=16", "--latent_norm=False", "--q_lora_rank=8"],
            "q_lora_rank: checkpoint None, config 8",
        ),
    ],
)
def test_a_conversion_train_py_cannot_make_is_one_line(
    pycode_small: Path, mha_run: Path, tmp_path: Path, extra: list[str], message: str
) -> None:
    r = cli(
        [
            "train.py",
            f"--dataset={pycode_small}",
            f"--out_dir={tmp_path}",
            *TINY_TRAIN,
            f"--init_from=convert:{mha_run}",
            *extra,
        ]
    )
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and message in r.stderr, r.stderr
    assert not (tmp_path / "ckpt.pt").exists()
