"""Chunked response log-probs (no [B, T, V] log-softmax kept) against the plain full computation."""

import pytest
import torch

from gapo.models import resolve_model
from gapo.trainer.actor import MicroBatch, response_logprobs


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(resolve_model("tiny-qwen2"), dtype=torch.float64)


def test_pack_places_responses_after_their_prompts():
    mb = MicroBatch.pack([[5, 6, 7], [8]], [[1, 2], [3, 4, 9, 9]], pad_id=0)
    assert mb.input_ids.tolist() == [[5, 6, 7, 1, 2], [8, 3, 4, 9, 9]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert mb.resp_pos.tolist() == [[2, 3, 0, 0], [0, 1, 2, 3]]
    assert mb.resp_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    short = MicroBatch.pack([[5, 6, 7, 8, 9]], [[1]], pad_id=0)
    assert short.input_ids.shape == (1, 6) and short.resp_pos.tolist() == [[4]]


@pytest.mark.parametrize("chunk", [1, 3, 1024])
def test_chunked_logprobs_values_entropy_and_gradients(model, chunk):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 9, 2)]
    responses = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (4, 1, 7)]
    mb = MicroBatch.pack(prompts, responses, pad_id=0)
    T = 0.7
    base, head = model.get_decoder(), model.get_output_embeddings()

    lp, _ = response_logprobs(base, head, mb, T, chunk=chunk)
    (lp * mb.resp_mask).sum().backward()
    grad_chunked = head.weight.grad.clone()
    model.zero_grad()

    full = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits / T  # [B, L, V]
    ref = torch.log_softmax(full, -1)
    expect = torch.zeros_like(lp)
    ent_expect = torch.zeros_like(lp)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        for t, tok in enumerate(r):
            expect[i, t] = ref[i, len(p) - 1 + t, tok]
            ent_expect[i, t] = -(ref[i, len(p) - 1 + t].exp() * ref[i, len(p) - 1 + t]).sum()
    (expect * mb.resp_mask).sum().backward()
    torch.testing.assert_close(lp, expect.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grad_chunked, head.weight.grad, rtol=1e-9, atol=1e-10)
    model.zero_grad()

    with torch.no_grad():
        lp2, ent = response_logprobs(base, head, mb, T, entropy=True, chunk=chunk)
    torch.testing.assert_close(lp2, expect.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ent, ent_expect.detach(), rtol=1e-9, atol=1e-9)
    assert torch.all(lp[mb.resp_mask == 0] == 0)
