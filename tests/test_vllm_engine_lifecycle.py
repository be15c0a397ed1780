"""Two things about the vLLM engine that only a GPU would otherwise show (issue 44, items 1 and 7): the model runner
is pinned to the V1 runner every CPU test ran (vLLM 0.32 picks V2 on any host with Triton and a GPU driver), and
close() lets the engine go for real, so that a process can start gapo-train on the same GPU after it."""

import gc
import sys
import types
import weakref

import pytest

from gapo import distributed
from gapo.rollout import vllm_engine
from gapo.rollout.types import SamplingConfig


class StubLLM:
    """vllm.LLM as VLLMEngine uses it when built and closed: records the runner variable it was built under, and
    answers the runner probe as a worker that built V2 (or not)."""

    def __init__(self, v2: bool, seen: dict, **kwargs):
        import os

        seen["runner_env"] = os.environ.get(vllm_engine.RUNNER_ENV[0])
        self.v2, self.seen, self.shutdowns = v2, seen, 0
        client = types.SimpleNamespace(shutdown=self._shutdown)  # vLLM's engine client, shut down at leave
        self.llm_engine = types.SimpleNamespace(engine_core=client, set_weight_version=lambda v: None)

    def _shutdown(self):
        self.shutdowns += 1
        self.seen["shutdowns"] = self.shutdowns

    def get_tokenizer(self):
        return None

    def collective_rpc(self, fn, args=()):
        return [fn(types.SimpleNamespace(use_v2_model_runner=self.v2), *args)]


@pytest.fixture
def build(monkeypatch):
    """build(v2=False) -> (engine, what the stub saw): a VLLMEngine through its real __init__ over StubLLM."""
    seen: dict = {}
    fake = types.ModuleType("vllm")
    fake.__version__ = "0.32.0"
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setenv(vllm_engine.RUNNER_ENV[0], "1")  # as a user's shell might have it: the engine must override it
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "0")

    def make(v2: bool = False):
        fake.LLM = lambda **kwargs: StubLLM(v2, seen, **kwargs)
        return vllm_engine.VLLMEngine("unused", dtype="float32", seed=0, max_model_len=64, compile="eager"), seen

    make.seen = seen
    yield make
    distributed._AT_LEAVE.clear()  # (entries of engines a failing test left open)


def test_the_v1_runner_is_pinned_before_vllm_builds_the_engine(build):
    _, seen = build()
    assert seen["runner_env"] == "0"


def test_vllm_picks_v2_where_triton_is_unless_pinned(monkeypatch):
    """vLLM's own rule (VllmConfig.use_v2_model_runner, vLLM 0.32), on a config that uses no V2-only feature: with
    Triton, as on every CUDA host, V2; with the engine's pin, V1. If vLLM moves the choice elsewhere, this fails."""
    import vllm.config.vllm as vllm_config

    config = types.SimpleNamespace(attention_config=types.SimpleNamespace(hisparse_config=None),
                                   _get_v2_model_runner_unsupported_features=lambda: [])
    monkeypatch.setattr(vllm_config, "HAS_TRITON", True)
    monkeypatch.delenv(vllm_engine.RUNNER_ENV[0], raising=False)
    assert vllm_config.VllmConfig.use_v2_model_runner.fget(config) is True
    monkeypatch.setenv(*vllm_engine.RUNNER_ENV)
    assert vllm_config.VllmConfig.use_v2_model_runner.fget(config) is False


def test_an_engine_whose_worker_built_v2_anyway_is_refused_and_closed(build):
    """The pin is void where vLLM cached its environment before it (an engine built earlier in the process)."""
    before = len(distributed._AT_LEAVE)
    with pytest.raises(RuntimeError, match="Model Runner V2"):
        build(v2=True)
    assert build.seen["shutdowns"] == 1 and len(distributed._AT_LEAVE) == before


def test_close_shuts_vllm_down_drops_the_at_leave_entry_and_lets_the_engine_go(build):
    engine, seen = build()
    entry, llm = engine._shutdown, weakref.ref(engine.llm)
    assert entry in distributed._AT_LEAVE
    engine.close()
    gc.collect()
    assert entry not in distributed._AT_LEAVE  # leave_distributed() will not run it a second time
    assert seen["shutdowns"] == 1 and engine.llm is None
    del entry  # (this test's own reference to vLLM's client)
    gc.collect()
    assert llm() is None  # nothing in gapo holds vLLM any more
    engine.close()  # a second close does nothing
    assert seen["shutdowns"] == 1
    with pytest.raises(RuntimeError, match="closed vLLM engine"):
        engine.generate([[1, 2]], SamplingConfig(n=1, temperature=1.0, top_p=1.0, max_new_tokens=2), seeds=[0])


def test_leave_early_refuses_what_was_never_registered():
    with pytest.raises(ValueError, match="not registered with at_leave"):
        distributed.leave_early(lambda: None)
