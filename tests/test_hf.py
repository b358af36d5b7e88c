"""The transformers models hf.to_hf makes compute what this project's model computes, and come back unchanged."""

from pathlib import Path

import pytest
import torch

from checkpoint import from_hf
from configurator import UserError
from hf import target_class, to_hf
from model import GPT, GPTConfig


def sharp_model(pos_encoding: str, n_kv_head: int, bias: bool, gelu: str = "exact") -> GPT:
    """A random model with weights 4x GPT-2's scale: peaked logits, so greedy decoding does not repeat one token."""
    torch.manual_seed(0)
    config = GPTConfig(block_size=32, vocab_size=61, n_layer=2, n_head=4, n_kv_head=n_kv_head, n_embd=32, bias=bias,
                       pos_encoding=pos_encoding, mlp_hidden=72, gelu=gelu)
    model = GPT(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4)
    return model


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
@pytest.mark.parametrize("pos_encoding", ["rope", "learned"])
def test_stock_transformers_model_gives_the_same_logits_and_greedy_tokens(pos_encoding: str, n_kv_head: int,
                                                                          bias: bool) -> None:
    model = sharp_model(pos_encoding, n_kv_head, bias, gelu="tanh" if bias else "exact")
    hf = to_hf(model)
    assert type(hf).__name__ == target_class(model.config)
    assert type(hf).__name__ == {"rope": "Starcoder2ForCausalLM", "learned": "GPTBigCodeForCausalLM" if n_kv_head == 1
                                 else "GPT2LMHeadModel"}[pos_encoding]
    idx = torch.randint(0, 61, (3, 32), generator=torch.Generator().manual_seed(1))  # up to block_size
    with torch.no_grad():
        ours, theirs = model(idx, targets=idx)[0], hf(idx).logits
    assert ours.abs().max() > 3  # peaked logits: a mapping error would show
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)
    prompt = idx[:, :8]
    with torch.no_grad():
        mine = model.generate(prompt, 20, temperature=0)
        hf_tokens = hf.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
    assert len(set(mine[:, 8:].flatten().tolist())) > 5  # not one token repeated
    assert torch.equal(hf_tokens, mine)


@pytest.mark.parametrize(("pos_encoding", "n_kv_head", "bias"), [("rope", 4, False), ("rope", 2, True),
                                                                ("rope", 1, False), ("learned", 1, True),
                                                                ("learned", 2, False)])
def test_a_saved_export_comes_back_with_the_same_logits(tmp_path: Path, pos_encoding: str, n_kv_head: int,
                                                       bias: bool) -> None:
    model = sharp_model(pos_encoding, n_kv_head, bias)
    to_hf(model).save_pretrained(tmp_path)
    back = from_hf(str(tmp_path)).eval()
    idx = torch.randint(0, 61, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(back(idx, targets=idx)[0], model(idx, targets=idx)[0], rtol=0, atol=1e-5)
    # learned GQA comes back as GPT-2, its K/V heads repeated: the same function with MHA's head count
    assert back.config.n_kv_head == (4 if (pos_encoding, n_kv_head) == ("learned", 2) else n_kv_head)


def test_a_folder_this_model_cannot_hold_is_refused_in_one_line(tmp_path: Path) -> None:
    hf = to_hf(sharp_model("rope", 2, False))
    hf.config.sliding_window, hf.config.norm_epsilon = 8, 1e-6
    hf.save_pretrained(tmp_path)
    with pytest.raises(UserError, match="cannot hold sliding_window=8, norm epsilon 1e-06"):
        from_hf(str(tmp_path))
