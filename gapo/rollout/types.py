"""Records passed from the rollout engines to the reward and the trainer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Rollout:
    """One sampled response. `logprobs` are the engine's, of the sampling distribution (after temperature),
    one per response token; the trainer compares them with its own to log the engine/trainer mismatch."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    truncated: bool  # stopped by max_new_tokens rather than by an end-of-sequence token
    text: str
    version: int = 0  # the trainer step whose weights sampled it (0: the initial weights); see gapo/trainer/sync.py


@dataclass(frozen=True)
class SamplingConfig:
    n: int
    temperature: float
    top_p: float
    max_new_tokens: int
    # Tokens that end a response besides the generation config's EOS: the chat template's end of turn
    # (gapo.data.stop_token_ids). A base model whose EOS is <|endoftext|> would otherwise write past <|im_end|>.
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class PushReceipt:
    """What an engine says it received and loaded in one weight push, for gapo.trainer.sync to check against what the
    trainer sent: `received` the tensor names it consumed (HF names, in order), `unloaded` the engine's own
    parameters that the push left untouched (vLLM's fused names, say)."""

    received: list[str]
    unloaded: list[str]
