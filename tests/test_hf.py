"""The transformers models hf.to_hf makes compute what this project's model computes (issue 33's weight mapping)."""

import pytest
import torch

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
