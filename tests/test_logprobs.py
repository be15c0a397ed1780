"""Chunked response log-probs (no [B, T, V] log-softmax kept) against the plain full computation."""

import pytest
import torch

from gapo.models import resolve_model
from gapo.trainer import logprobs as logprobs_module
from gapo.trainer.logprobs import MicroBatch, response_logprobs


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


def test_pack_carries_what_the_loss_needs_of_each_rollout():
    """The update's per-rollout fields travel in the micro-batch, also when its prompts are shared."""
    index, adv = torch.tensor([4, 5, 6]), torch.tensor([0.5, -0.5, 0.25])
    c, k = torch.tensor([1, 1, 2]), torch.tensor([2, 2, 4])
    mb = MicroBatch.pack([[5, 6, 7], [5, 6, 7], [8, 9]], [[1, 2], [3], [4]], pad_id=0, share_prompts=True,
                         keep=torch.tensor([True, False, True]), engine_logp=[[-0.5, -0.25], [-1.0], [-2.0]],
                         index=index, adv=adv, c=c, k=k).to(torch.device("cpu"))
    assert mb.shared is not None
    assert all(torch.equal(got, want) for got, want in ((mb.index, index), (mb.adv, adv), (mb.c, c), (mb.k, k)))
    assert mb.resp_mask.tolist() == [[1, 1], [0, 0], [1, 0]]  # a rollout left out keeps its row, not its tokens
    assert mb.engine_logp.tolist() == [[-0.5, -0.25], [-1.0, 0.0], [-2.0, 0.0]]
    assert mb.old_logp is None and mb.ref_logp is None  # set by the old-log-prob pass


@pytest.mark.parametrize("chunk, rows", [(1, 64), (3, 2), (1024, 64), (1024, 4)])
def test_chunked_logprobs_values_entropy_and_gradients(model, chunk, rows, monkeypatch):
    monkeypatch.setattr(logprobs_module, "ROWS", rows)  # softmax blocks inside a chunk, and their seams
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


def test_pack_shares_repeated_prompts():
    mb = MicroBatch.pack([[5, 6, 7], [8, 9], [5, 6, 7]], [[1, 2], [3], [4]], pad_id=0, share_prompts=True)
    sp = mb.shared
    assert sp.prefix_ids.tolist() == [[5, 6], [8, 0]] and sp.prefix_mask.tolist() == [[1, 1], [1, 0]]
    assert sp.row.tolist() == [0, 1, 0]
    assert sp.suffix_ids.tolist() == [[7, 1, 2], [9, 3, 0], [7, 4, 0]]
    assert sp.suffix_pos.tolist() == [[2, 3, 4], [1, 2, 3], [2, 3, 4]]
    # Nothing to share, or a one-token prompt (an all-padding prefix row): the plain layout only.
    assert MicroBatch.pack([[5, 6], [7, 8]], [[1], [2]], 0, share_prompts=True).shared is None
    assert MicroBatch.pack([[5], [5]], [[1], [2]], 0, share_prompts=True).shared is None


def test_shared_prompts_give_the_same_logprobs_entropy_and_gradients(model):
    """Each distinct prompt run once, its rollouts on its KV cache, must equal running every rollout whole.
    (Qwen2's RMSNorm computes in fp32 even in an fp64 model, hence 1e-6 rather than 1e-10.)"""
    g = torch.Generator().manual_seed(1)
    pa, pb = torch.randint(3, 300, (6,), generator=g).tolist(), torch.randint(3, 300, (3,), generator=g).tolist()
    prompts = [pa, pb, pa, pa, pb, pb, pa]
    responses = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (4, 1, 7, 2, 5, 3, 6)]
    adv = torch.randn(len(prompts), 1, generator=g, dtype=torch.float64)
    base, head = model.get_decoder(), model.get_output_embeddings()
    out = {}
    for share in (False, True):
        mb = MicroBatch.pack(prompts, responses, pad_id=0, share_prompts=share)
        assert (mb.shared is not None) == share
        lp, _ = response_logprobs(base, head, mb, 0.7)
        model.zero_grad()
        (lp * mb.resp_mask * adv).sum().backward()
        with torch.no_grad():
            _, ent = response_logprobs(base, head, mb, 0.7, entropy=True)
        out[share] = lp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(out[True][1], out[False][1], rtol=1e-9, atol=1e-9)
    for name, grad in out[False][2].items():
        assert grad.abs().max() > 0, name  # every parameter, the prompts' included, takes part
        torch.testing.assert_close(out[True][2][name], grad, rtol=1e-6, atol=1e-6 * float(grad.abs().max()))


def test_shared_prompts_gradient_repeats_to_the_bit():
    """On CPU in fp32 the same micro-batch gives the same gradient every time. Sixteen rollouts of one prompt (a
    group, as the demo packs it) make the prompt's KV cache gradient a sum over repeated rows large enough for
    torch's parallel kernels (>= 32768 elements per layer here): summed with index_put_'s atomic adds it changed
    from one backward to the next, and two runs of the demo's SmolLM2 differed from their first update on."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-qwen2"), dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, 300, (48,), generator=g).tolist()
    responses = [torch.randint(3, 300, (n,), generator=g).tolist() for n in range(3, 19)]
    mb = MicroBatch.pack([prompt] * len(responses), responses, pad_id=0, share_prompts=True)
    assert mb.shared is not None and mb.shared.row.tolist() == [0] * 16
    base, head = model.get_decoder(), model.get_output_embeddings()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the parallel path needs more than one thread
    try:
        grads = []
        for _ in range(8):
            model.zero_grad()
            lp, _ = response_logprobs(base, head, mb, 1.0)
            (lp * mb.resp_mask).sum().backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    finally:
        torch.set_num_threads(threads)
    unequal = {n for later in grads[1:] for n, gr in later.items() if not torch.equal(gr, grads[0][n])}
    assert not unequal, f"gradients that differ between identical backward passes: {sorted(unequal)}"


@pytest.mark.parametrize("share, checkpointing", [(True, False), (False, True), (False, False)])
def test_old_logprob_pass_and_update_agree_exactly_in_bf16(share, checkpointing):
    """The old-log-prob pass (no grad, with entropy) and the update's forward must give the same numbers to
    the last bit, in bf16 as the paper runs train, whatever the model mode: otherwise the first mini-batch's
    IS ratio is not 1 and GSPO's 3e-3 bound clips arithmetic noise."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-qwen2"), dtype=torch.bfloat16)
    if checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lm.train()
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, 300, (7,), generator=g).tolist()
    responses = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 9, 3, 8)]
    mb = MicroBatch.pack([prompt] * 4, responses, pad_id=0, share_prompts=share)
    base, head = lm.get_decoder(), lm.get_output_embeddings()
    with torch.no_grad():
        old, ent = response_logprobs(base, head, mb, 0.9, entropy=True)
    new, _ = response_logprobs(base, head, mb, 0.9)
    assert torch.equal(new.detach(), old)
    assert bool((ent[mb.resp_mask.bool()] > 0).all())
