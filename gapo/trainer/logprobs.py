"""Response log-probs of a packed micro-batch: the one computation behind the old-log-prob pass and the update.

Pure torch (no DeepSpeed, vLLM or pydantic): the micro-batch record and the packing of a step's rollouts into it
(mini-batches, micro-batches by count or token budget, shared prompts), and the chunked log-prob kernel the actor's
DeepSpeed engine runs as its forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

# The chunking's constants live in the memory plan, which budgets them without importing torch.
from gapo.distributed import agree
from gapo.memory import LOGIT_CHUNK
from gapo.memory import LOGPROB_ROWS as ROWS
from gapo.rollout.types import Rollout


@dataclass
class SharedPrompts:
    """The micro-batch laid out so that each distinct prompt is run once: its KV cache is shared by all of
    its rollouts. The k rollouts of a group repeat one prompt, and in RL batches the prompt is often half of
    the tokens, so this removes up to (k-1)/k of the prompt compute in every forward and backward.

    A prompt p is split into p[:-1] (the shared prefix) and p[-1] (the first token of the rollout's own
    suffix), so the logits predicting response token t sit at suffix position t.
    """

    prefix_ids: Tensor  # [U, P] distinct prompts without their last token, right-padded
    prefix_mask: Tensor  # [U, P]
    row: Tensor  # [B] which distinct prompt each rollout continues
    suffix_ids: Tensor  # [B, S] last prompt token + response, right-padded
    suffix_mask: Tensor  # [B, S]
    suffix_pos: Tensor  # [B, S] absolute positions (for rotary embeddings)


@dataclass
class MicroBatch:
    """Rollouts packed for one forward (prompt + response, right-padded to this micro-batch's own length), and
    what the loss needs of each of them (gapo.trainer.losses.policy_loss). A bare forward (tests, benches)
    leaves the per-rollout fields unset."""

    input_ids: Tensor  # [B, L]
    attention_mask: Tensor  # [B, L]
    resp_pos: Tensor  # [B, T] position in input_ids of the logits predicting response token t
    resp_ids: Tensor  # [B, T] response tokens (0 on padding)
    resp_mask: Tensor  # [B, T] 1 on response tokens of the rollouts in the loss (see `pack`'s keep)
    shared: SharedPrompts | None = None  # set when rollouts repeat a prompt (see SharedPrompts)
    # --- per rollout, for the update -------------------------------------------------------------------
    index: Tensor | None = None  # [B] long: each rollout's place among this rank's rollouts of the step
    adv: Tensor | None = None  # [B] float: advantage A_i
    c: Tensor | None = None  # [B] long: correct rollouts in its group
    k: Tensor | None = None  # [B] long: size of its group
    engine_logp: Tensor | None = None  # [B, T] the engine's log-probs of the sampled tokens (0 on padding)
    old_logp: Tensor | None = None  # [B, T] log pi_old: set by the old-log-prob pass (or the engine's)
    ref_logp: Tensor | None = None  # [B, T] the reference policy's: set when there is a KL penalty
    rollout_w: Tensor | None = None  # [B, T] sampler-trainer correction weights (algorithm.rollout_correction)
    # [B, T] resp_mask less the tokens the rollout correction masks; None: resp_mask. Apart from resp_mask because
    # the forwards must see the same tokens in the old-log-prob pass and the update (same logit chunks, so the
    # first mini-batch's ratio stays exactly 1); only the loss and its normaliser leave them out.
    loss_mask: Tensor | None = None

    @property
    def in_loss(self) -> Tensor:
        """[B, T] the tokens the loss, its normaliser and its clip statistics count."""
        return self.resp_mask if self.loss_mask is None else self.loss_mask

    @classmethod
    def pack(cls, prompts: list[list[int]], responses: list[list[int]], pad_id: int, *,
             share_prompts: bool = False, keep: Tensor | None = None, engine_logp: list[list[float]] | None = None,
             index: Tensor | None = None, adv: Tensor | None = None, c: Tensor | None = None,
             k: Tensor | None = None) -> MicroBatch:
        """keep [B] bool: a rollout left out of the loss keeps its row (every rank must run the same forwards
        under ZeRO-3) with no tokens in resp_mask, hence none in the loss, its normaliser or the metrics."""
        B = len(prompts)
        L = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
        T = max(1, max(len(r) for r in responses))
        ids = torch.full((B, L), pad_id, dtype=torch.long)
        att = torch.zeros(B, L, dtype=torch.long)
        pos = torch.zeros(B, T, dtype=torch.long)
        rid = torch.zeros(B, T, dtype=torch.long)
        rmask = torch.zeros(B, T)
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
            n = len(p) + len(r)
            ids[i, :n] = torch.tensor(p + r)
            att[i, :n] = 1
            pos[i, :len(r)] = torch.arange(len(p) - 1, n - 1)
            rid[i, :len(r)] = torch.tensor(r, dtype=torch.long)
            rmask[i, :len(r)] = 1
        distinct = list(dict.fromkeys(tuple(p) for p in prompts))
        shared = None
        if share_prompts and can_share(prompts):
            P = max(len(p) for p in distinct) - 1
            S = T + 1
            pre_ids = torch.full((len(distinct), P), pad_id, dtype=torch.long)
            pre_mask = torch.zeros(len(distinct), P, dtype=torch.long)
            for u, p in enumerate(distinct):
                pre_ids[u, :len(p) - 1] = torch.tensor(p[:-1])
                pre_mask[u, :len(p) - 1] = 1
            slot = {p: u for u, p in enumerate(distinct)}
            suf_ids = torch.full((B, S), pad_id, dtype=torch.long)
            suf_mask = torch.zeros(B, S, dtype=torch.long)
            for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
                suf_ids[i, :len(r) + 1] = torch.tensor(p[-1:] + r)
                suf_mask[i, :len(r) + 1] = 1
            row = torch.tensor([slot[tuple(p)] for p in prompts])
            plen = torch.tensor([len(p) - 1 for p in prompts])
            shared = SharedPrompts(pre_ids, pre_mask, row, suf_ids, suf_mask, plen[:, None] + torch.arange(S))
        if keep is not None:
            rmask[~keep] = 0
        eng = None
        if engine_logp is not None:
            eng = torch.zeros(B, T)
            for i, lp in enumerate(engine_logp):
                eng[i, :len(lp)] = torch.tensor(lp)
        return cls(ids, att, pos, rid, rmask, shared, index=index, adv=adv, c=c, k=k, engine_logp=eng)

    def to(self, device: torch.device) -> MicroBatch:
        """Packed on the CPU, moved once to the trainer's device."""
        def moved(record):  # every tensor field of a dataclass record
            return {f.name: getattr(record, f.name).to(device) for f in fields(record)
                    if isinstance(getattr(record, f.name), Tensor)}

        return replace(self, **moved(self),
                       shared=None if self.shared is None else replace(self.shared, **moved(self.shared)))


def micro_batch_rows(lengths: list[int], max_rows: int, max_tokens: int | None, count: int | None = None
                     ) -> list[list[int]]:
    """Which rollouts (indices into `lengths`, their prompt + response lengths) go into each micro-batch.

    Without a token budget: consecutive runs of `max_rows`. With one: longest first, each micro-batch takes
    rollouts while rows x its longest sequence (the padded tensor the decoder runs) stays within `max_tokens`,
    so a 24k-token rollout gets a micro-batch to itself and short ones share theirs without its padding.
    `count`: split the largest micro-batches in two until there are that many (under ZeRO every rank must run
    the same number of forwards; the ranks agree on the largest count)."""
    if max_tokens is None:
        bins = [list(range(i, min(i + max_rows, len(lengths)))) for i in range(0, len(lengths), max_rows)]
    else:
        bins = []
        for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
            if bins and len(bins[-1]) < max_rows and (len(bins[-1]) + 1) * lengths[bins[-1][0]] <= max_tokens:
                bins[-1].append(i)
            else:
                bins.append([i])
    while count is not None and len(bins) < count:
        j = max(range(len(bins)), key=lambda b: len(bins[b]))
        if len(bins[j]) < 2:
            raise ValueError(f"cannot split {len(lengths)} rollouts into {count} micro-batches")
        half = len(bins[j]) // 2
        bins[j:j + 1] = [bins[j][:half], bins[j][half:]]
    return bins


def can_share(prompts: list[list[int]]) -> bool:
    """Worth it only when a prompt repeats; a one-token prompt would leave an all-padding prefix row, whose fully
    masked attention is undefined."""
    return len(set(map(tuple, prompts))) < len(prompts) and min(len(p) for p in prompts) >= 2


def pack_step(rollouts: list[Rollout], adv: Tensor, c: Tensor, k: Tensor, keep: Tensor, *, mini: int, micro: int,
              max_tokens: int | None, pad_id: int, share_prompts: bool, device: torch.device) -> list[list[MicroBatch]]:
    """A rank's rollouts of one step as mini-batches (one optimizer step each, `mini` rollouts) of micro-batches.

    adv, c, k, keep: [N], one per rollout. Micro-batches by count (`micro` rollouts) or by token budget; every rank
    runs the largest count any rank needs for each mini-batch, since each forward is a collective under ZeRO-3.
    Each micro-batch carries what the loss needs of its rollouts, and is moved once to `device`."""
    lengths = [len(x.prompt_ids) + len(x.response_ids) for x in rollouts]
    starts = range(0, len(rollouts), mini)
    counts = agree([len(micro_batch_rows(lengths[m0:m0 + mini], micro, max_tokens)) for m0 in starts], device)
    bins = [[torch.tensor(b) + m0 for b in micro_batch_rows(lengths[m0:m0 + mini], micro, max_tokens, n)]
            for m0, n in zip(starts, counts, strict=True)]  # rollout indices per micro-batch
    # Sharing runs the decoder twice (prompts, then suffixes): a different sequence of module calls. Under ZeRO-3
    # every rank must make the same calls, so the i-th micro-batch shares only if it does so on every rank.
    agreed = iter(agree([int(share_prompts and can_share([rollouts[j].prompt_ids for j in b.tolist()]))
                         for mini_bins in bins for b in mini_bins], device, op="min"))
    return [[MicroBatch.pack([rollouts[j].prompt_ids for j in b], [rollouts[j].response_ids for j in b], pad_id,
                             share_prompts=bool(next(agreed)), keep=keep[b], index=b, adv=adv[b], c=c[b], k=k[b],
                             engine_logp=[rollouts[j].logprobs for j in b]).to(device)
             for b in bins_of_mini] for bins_of_mini in bins]


def _decode(base: torch.nn.Module, mb: MicroBatch) -> tuple[Tensor, Tensor]:
    """Last hidden states [B, L', H] and, for each response token, its row in them [B, T].

    The path depends on the micro-batch alone (shared prompts or not, decided when it was packed), never on
    the mode or on grad being enabled: the old-log-prob pass and the update must run the same computation,
    or the first mini-batch's IS ratio is not 1 (in bf16 the two paths differ by far more than a GSPO bound).
    """
    sp = mb.shared
    if sp is None:
        out = base(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False)
        return out.last_hidden_state, mb.resp_pos
    cache = base(input_ids=sp.prefix_ids, attention_mask=sp.prefix_mask, use_cache=True).past_key_values
    if cache is None:
        raise RuntimeError("the model returned no KV cache for the shared prompts; pack micro-batches with "
                           "share_prompts=False when gradient checkpointing is on (transformers drops the cache)")
    # [U, ...] -> [B, ...], differentiable: each prompt's gradient sums its rollouts'. reorder_cache (beam search's)
    # selects with index_select, whose backward sums repeated rows in order; batch_select_indices' indexing sums them
    # with index_put_(accumulate=True), whose CPU kernel adds with parallel atomics in an order that changes from run
    # to run (two runs of SmolLM2's demo differed from the first update on; the tiny models' caches stay serial).
    cache.reorder_cache(sp.row)
    out = base(input_ids=sp.suffix_ids, attention_mask=torch.cat([sp.prefix_mask[sp.row], sp.suffix_mask], 1),
               position_ids=sp.suffix_pos, past_key_values=cache, use_cache=True)
    return out.last_hidden_state, torch.arange(mb.resp_ids.shape[1], device=mb.resp_ids.device).expand_as(mb.resp_ids)


def _up(x: Tensor) -> Tensor:
    """At least fp32 (a bf16 log-softmax loses the small differences the IS ratio is made of)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _logp_lse(logits: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """log softmax(logits / T)[target] and the normaliser logsumexp(logits / T), ROWS rows at a time.
    The one formula for every log-prob the trainer takes (old-log-prob pass and update alike)."""
    lse = torch.cat([torch.logsumexp(_up(b) / temperature, -1) for b in logits.split(ROWS)])  # [N]
    return _up(logits.gather(-1, targets[:, None]).squeeze(-1)) / temperature - lse, lse


class _TokenLogp(torch.autograd.Function):
    """log softmax(logits / T)[target] for a chunk of rows, at >= fp32, holding nothing of size [N, V] but the
    logits themselves: the normaliser is taken ROWS rows at a time, and backward turns the saved logits into
    their own gradient in place. (log_softmax or logsumexp under autograd keep 2-4 more [N, V] tensors.)"""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float) -> Tensor:
        logp, lse = _logp_lse(logits, targets, temperature)
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature = temperature
        return logp

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor, None, None]:
        logits, targets, lse = ctx.saved_tensors  # ours alone (recomputed by response_logprobs' checkpoint)
        gt = g / ctx.temperature
        # d/dx (x_target / T - logsumexp(x / T)) = (onehot(target) - softmax(x / T)) / T
        for b, gb, lb in zip(logits.split(ROWS), gt.split(ROWS), lse.split(ROWS), strict=True):
            b.copy_((_up(b) / ctx.temperature - lb[:, None]).exp_().mul_(-gb[:, None]))
        return logits.scatter_add_(-1, targets[:, None], gt[:, None].to(logits.dtype)), None, None


def _token_logp(head: torch.nn.Module, h: Tensor, targets: Tensor, temperature: float) -> Tensor:
    return _TokenLogp.apply(head(h), targets, temperature)


@torch.no_grad()
def _token_logp_entropy(head: torch.nn.Module, h: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    logits = head(h)
    logp, lse = _logp_lse(logits, targets, temperature)
    # H = lse - E_p[x / T], p = softmax(x / T)
    ents = [lb - (torch.softmax(_up(b) / temperature, -1) * (_up(b) / temperature)).sum(-1)
            for b, lb in zip(logits.split(ROWS), lse.split(ROWS), strict=True)]
    return logp, torch.cat(ents)


def response_logprobs(base: torch.nn.Module, head: torch.nn.Module, mb: MicroBatch, temperature: float, *,
                      entropy: bool = False, chunk: int | None = None, n_chunks: int | None = None
                      ) -> tuple[Tensor, Tensor | None]:
    """log pi(response token) under the sampling temperature: [B, T] (0 on padding); with `entropy`
    (no gradient) also the per-token entropy [B, T].

    The decoder runs on the packed sequences (each distinct prompt once, see SharedPrompts); the vocab
    projection runs only on response positions, `chunk` tokens at a time (prompt positions would each cost
    a [V] projection for nothing), and in training each chunk's logits are recomputed in backward rather
    than stored.
    """
    h, resp_pos = _decode(base, mb)  # [B, L, H]
    rows, cols = mb.resp_mask.nonzero(as_tuple=True)
    hr = h[rows, resp_pos[rows, cols]]  # [N, H], N = response tokens
    targets = mb.resp_ids[rows, cols]
    # Under ZeRO-3 the head's weight is gathered once for the whole forward (Policy registers it), but each chunk
    # still enters the head module's ZeRO hooks: all ranks make the same number of calls, and the same number in
    # every forward, or DeepSpeed's prefetch trace is invalidated (and checked across ranks) at each change. So
    # the count is fixed for the run (`n_chunks`: the most response tokens a micro-batch can hold, in chunks), and
    # a chunk with no tokens projects one real hidden row and drops it (which also keeps the loss attached to
    # the graph when a micro-batch is empty). Without a fixed count the ranks agree on this forward's largest.
    needed = max(1, math.ceil(hr.shape[0] / (chunk or LOGIT_CHUNK)))
    if n_chunks is not None:
        if needed > n_chunks:
            raise ValueError(f"{hr.shape[0]} response tokens need {needed} logit chunks, more than the run's "
                             f"{n_chunks} (micro-batch rows x rollout.max_new_tokens)")
    else:
        [n_chunks] = agree([needed], hr.device)
    logps, ents = [], []
    for hc, tc in zip(torch.tensor_split(hr, int(n_chunks)), torch.tensor_split(targets, int(n_chunks)),
                      strict=True):
        dummy = hc.shape[0] == 0
        if dummy:
            hc, tc = h[:1, 0], mb.input_ids[:1, 0]
        if entropy:  # the old-logprob pass: no gradient, one projection gives both
            lp, ent = _token_logp_entropy(head, hc, tc, temperature)
            ents.append(ent[:0] if dummy else ent)
        elif torch.is_grad_enabled():
            lp = checkpoint(_token_logp, head, hc, tc, temperature, use_reentrant=False)
        else:
            lp = _token_logp(head, hc, tc, temperature)
        logps.append(lp[:0] + 0 * lp.sum() if dummy else lp)  # empty, but the head stays in the graph

    def unflatten(parts: list[Tensor]) -> Tensor:
        flat = torch.cat(parts)
        out = torch.zeros(mb.resp_mask.shape, dtype=flat.dtype, device=flat.device).index_put((rows, cols), flat)
        return out + 0 * flat.sum() if rows.numel() == 0 else out

    return unflatten(logps), (unflatten(ents) if entropy else None)
