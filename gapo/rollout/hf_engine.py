"""transformers `generate` behind the engine interface: for machines without vLLM, and the reference the
vLLM engine is checked against in the tests. Slow (no paged KV cache, no continuous batching)."""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
from torch import Tensor

from gapo.rollout.types import PushReceipt, Rollout, SamplingConfig


def engine_device() -> torch.device:
    """This rank's GPU (torchrun's LOCAL_RANK: one rank per GPU of the node), or the CPU without CUDA."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


class HFEngine:
    def __init__(self, model_dir: str, *, dtype: torch.dtype = torch.float32):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = engine_device()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(self.device).eval()
        self.params = dict(self.model.named_parameters(remove_duplicate=False))  # tied names too
        self.version = 0  # the trainer step whose weights it holds (see VLLMEngine)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int]) -> list[list[Rollout]]:
        eos = self.model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos]) | {self.tokenizer.eos_token_id, *sampling.stop_token_ids}
        eos.discard(None)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        groups = []
        for prompt, seed in zip(prompts, seeds, strict=True):
            ids = torch.tensor([prompt], device=self.device)
            # A per-request seed, as vLLM's SamplingParams(seed=...); on GPU the sampling draws from this
            # device's generator, which fork_rng must then save and restore too.
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                torch.manual_seed(seed)
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                          temperature=sampling.temperature, top_p=sampling.top_p, top_k=0,
                                          max_new_tokens=sampling.max_new_tokens,
                                          num_return_sequences=sampling.n, output_logits=True,
                                          return_dict_in_generate=True, pad_token_id=pad, eos_token_id=sorted(eos))
            logits = torch.stack(out.logits, 1).float() / sampling.temperature  # [n, steps, V]
            resp = out.sequences[:, ids.shape[1]:]
            logp = torch.log_softmax(logits, -1).gather(-1, resp[..., None]).squeeze(-1)
            group = []
            for j in range(sampling.n):
                toks = resp[j].tolist()
                end = next((i + 1 for i, t in enumerate(toks) if t in eos), None)
                toks = toks[:end] if end else toks
                group.append(Rollout(prompt_ids=list(prompt), response_ids=toks, logprobs=logp[j, :len(toks)].tolist(),
                                     truncated=end is None, version=self.version,
                                     text=self.tokenizer.decode(toks, skip_special_tokens=True)))
            groups.append(group)
        return groups

    def sleep(self) -> None:
        raise RuntimeError("the hf engine cannot sleep (rollout.sleep_between_steps needs rollout.engine=vllm)")

    @torch.no_grad()
    def push_weights(self, weights: Iterable[tuple[str, Tensor]], version: int) -> PushReceipt:
        """copy_ moves each tensor to the engine's device, whichever device the trainer gathered it on."""
        received = []
        for name, tensor in weights:
            self.params[name].copy_(tensor)
            received.append(name)
        self.version = version
        return PushReceipt(received, sorted(self.params.keys() - set(received)))
