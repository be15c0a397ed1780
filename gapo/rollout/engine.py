"""What the loop and gapo-eval need from a rollout engine, and building one by name."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
from torch import Tensor

from gapo.rollout.types import PushReceipt, Rollout, SamplingConfig


class Engine(Protocol):
    """A rollout engine: VLLMEngine (vllm_engine.py), HFEngine (hf_engine.py), its slow reference, or on a split
    job's trainer RemoteEngine (split.py), its generator's."""

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                 seeds: list[int]) -> list[list[Rollout]]:
        """sampling.n rollouts per prompt; seeds[i] makes prompt i's samples repeatable."""
        ...

    def push_weights(self, weights: Iterable[tuple[str, Tensor]], version: int) -> PushReceipt:
        """Load the trainer's weights (HF names) of trainer step `version`; the next generate() samples from them
        and labels its rollouts with that version. Returns what arrived, for gapo.trainer.sync to check."""
        ...

    def sleep(self) -> None:
        """Give back the accelerator memory of weights and KV cache while the trainer works
        (rollout.sleep_between_steps); the next push_weights wakes the engine. Only vLLM on a GPU can: the config
        refuses the setting elsewhere, and the other engines raise."""
        ...


def build_engine(kind: str, model_dir: str, *, dtype: str, seed: int, max_model_len: int,
                 gpu_memory_utilization: float = 0.5, kv_cache_gb: float | None = None, sleep_mode: bool = False,
                 compile: str = "auto") -> Engine:
    """The rollout engine of `kind` (vllm | hf); on CPU vLLM's KV cache defaults to 1 GiB per rank.
    A vLLM engine must be built after init_distributed: it joins the world group."""
    if kind == "hf":
        from gapo.rollout.hf_engine import HFEngine

        return HFEngine(model_dir, dtype=torch.bfloat16 if dtype == "bfloat16" else torch.float32)
    from gapo.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(model_dir, dtype=dtype, seed=seed, max_model_len=max_model_len,
                      gpu_memory_utilization=gpu_memory_utilization, sleep_mode=sleep_mode,
                      kv_cache_gb=kv_cache_gb or (None if torch.cuda.is_available() else 1.0),
                      compile=compile)
