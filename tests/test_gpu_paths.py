"""The GPU-only branches, driven on CPU through their real code: vLLM sleep mode against a recording stand-in
for vllm.LLM, the transformers engine's device choice, CUDA RNG states in checkpoints with faked CUDA
functions, and one build of a built-in model when several processes ask for it at once."""

import gc
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from gapo.errors import ConfigError
from gapo.rollout import vllm_engine
from gapo.rollout.hf_engine import HFEngine, engine_device
from gapo.rollout.types import SamplingConfig
from gapo.trainer import checkpoint, reshard

ROOT = Path(__file__).resolve().parents[1]
SAMPLING = SamplingConfig(n=1, temperature=1.0, top_p=1.0, max_new_tokens=4)


# ------------------------------------------------------------------------------------ vLLM sleep mode
class FakeLLM:
    """Records what the engine asks of vLLM, and fails where vLLM 0.32 would misbehave: writing weights
    into unmapped memory, or generating while any memory sleeps (its scheduler stays paused)."""

    def __init__(self, events: list, kwargs: dict, fully_awake_after_wake: bool = True):
        self.events, self.kwargs, self.fully_awake = events, kwargs, fully_awake_after_wake
        self.sleeping: set[str] = set()

    def get_tokenizer(self):
        return None

    def generate(self, prompts, params, use_tqdm):
        assert not self.sleeping, f"generate with {self.sleeping} asleep"
        self.events.append("generate")
        done = types.SimpleNamespace(token_ids=[7], logprobs=[{7: types.SimpleNamespace(logprob=-0.5)}],
                                     finish_reason="stop", text="x", weight_versions=None)
        return [types.SimpleNamespace(outputs=[done]) for _ in prompts]

    def sleep(self, level):
        self.events.append(f"sleep:{level}")
        self.sleeping = {"weights", "kv_cache"}

    def wake_up(self, tags):
        self.events.append("wake:" + ",".join(tags))
        self.sleeping -= set(tags)
        return not self.sleeping and self.fully_awake

    def collective_rpc(self, fn, args=()):
        """The worker as gapo's _reload sees it: reload_weights runs the model's load_weights over the iterator."""
        model = types.SimpleNamespace(named_parameters=lambda: [(n, None) for n in ("embed", "head", "w")])
        model.load_weights = lambda ws: {name for name, _ in ws}

        def reload_weights(weights_iterator):
            assert "weights" not in self.sleeping, "weights written into unmapped memory"
            names = sorted(model.load_weights(weights_iterator))
            self.events.append("load:" + ",".join(names))

        worker = types.SimpleNamespace(reload_weights=reload_weights, use_v2_model_runner=False,  # V1, as pinned
                                       model_runner=types.SimpleNamespace(get_model=lambda: model))
        return [fn(worker, *args)]

    @property
    def llm_engine(self):
        """The version label and the shutdown gapo uses (set_weight_version; engine_core.shutdown at leave)."""
        return types.SimpleNamespace(set_weight_version=lambda v: self.events.append(f"version:{v}"),
                                     engine_core=types.SimpleNamespace(shutdown=lambda: None))

    def reset_prefix_cache(self):
        self.events.append("reset_prefix_cache")
        return self.reset_ok

    reset_ok = True  # vLLM returns False while KV blocks are still in use


@pytest.fixture
def fake_vllm(monkeypatch):
    """(events, build): `build(sleep_mode)` makes a VLLMEngine through its real __init__ over FakeLLM."""
    events: list[str] = []
    llms: list[FakeLLM] = []
    fully_awake = [True]

    def llm(**kwargs):
        llms.append(FakeLLM(events, kwargs, fully_awake[0]))
        fake.last_kwargs = kwargs
        return llms[-1]

    fake = types.ModuleType("vllm")
    fake.__version__ = "0.32.0"  # the release this FakeLLM behaves as (tests/test_vllm_contract.py: 0.26's)
    fake.LLM = llm
    fake.SamplingParams = lambda **kw: kw
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    real_collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: (events.append("gc"), real_collect(*a))[1])

    def build(sleep_mode: bool, wake_completes: bool = True):
        fully_awake[0] = wake_completes
        engine = vllm_engine.VLLMEngine("unused", dtype="bfloat16", seed=0, max_model_len=64, sleep_mode=sleep_mode)
        assert llms[-1].kwargs["enable_sleep_mode"] is sleep_mode
        return engine

    return events, build


@pytest.fixture(scope="session")
def engine_args_of_vllm() -> set[str]:
    """The keyword arguments the installed vLLM's LLM() takes (EngineArgs' fields), read before any test fakes it."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    return {f.name for f in dataclasses.fields(EngineArgs)}


@pytest.mark.parametrize("compile_mode, aot, eager", [("auto", "0", False), ("cache", "0", False), ("aot", "1", False),
                                                      ("eager", "as it was", True)])
def test_every_engine_argument_is_one_vllm_knows_and_compile_modes_map(engine_args_of_vllm, fake_vllm, monkeypatch,
                                                                       compile_mode, aot, eager):
    """The arguments gapo gives vLLM on GPU only (sleep mode, CUDA-graph offload) are checked here against the
    installed vLLM's own EngineArgs, so a misspelt one fails on CPU, not on the first GPU; rollout.compile picks
    vLLM's compile path (auto on CPU: inductor's cache without the AOT artifacts vLLM cannot load back there)."""
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "as it was")  # and as it was after the test: the engine writes it
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    for sleep_mode in (False, True):
        vllm_engine.VLLMEngine("unused", dtype="bfloat16", seed=0, max_model_len=64, sleep_mode=sleep_mode,
                               kv_cache_gb=1.0, compile=compile_mode)
        kwargs = sys.modules["vllm"].last_kwargs
        assert set(kwargs) <= engine_args_of_vllm, set(kwargs) - engine_args_of_vllm
        assert kwargs["enforce_eager"] is eager and os.environ.get("VLLM_USE_AOT_COMPILE") == aot
        assert kwargs.get("sleep_mode_offload_cudagraph", False) is sleep_mode


def test_configs_written_before_rollout_compile_still_read():
    from gapo.configfile import resolve

    assert resolve({"rollout": {"enforce_eager": True}}).rollout.compile == "eager"
    assert resolve({"rollout": {"enforce_eager": False}}).rollout.compile == "auto"


def weights(events: list):
    """The trainer's gathered weights, recording when each is produced (ZeRO-3 gathers them lazily)."""
    for name in ("embed", "head"):
        events.append(f"gather:{name}")
        yield name, torch.zeros(2)


def test_sleep_cycle_frees_torch_cache_and_wakes_weights_then_kv_cache(fake_vllm):
    events, build = fake_vllm
    engine = build(sleep_mode=True)
    engine.generate([[1, 2]], SAMPLING, seeds=[0])
    engine.sleep()
    with pytest.raises(RuntimeError, match="sleeping vLLM engine"):
        engine.generate([[1, 2]], SAMPLING, seeds=[0])
    receipt = engine.push_weights(weights(events), version=1)
    engine.generate([[1, 2]], SAMPLING, seeds=[0])
    assert events == ["version:0", "generate", "sleep:2",
                      "gc", "empty_cache", "wake:weights",
                      "gather:embed", "gather:head", "load:embed,head", "version:1",
                      "gc", "empty_cache", "wake:kv_cache",
                      "reset_prefix_cache", "generate"]
    assert receipt.received == ["embed", "head"] and receipt.unloaded == ["w"]  # what the sync check reads


def test_push_into_an_awake_engine_wakes_nothing(fake_vllm):
    """Resume pushes the checkpoint's weights into a freshly built (awake) engine."""
    events, build = fake_vllm
    engine = build(sleep_mode=True)
    engine.push_weights(weights(events), version=3)
    assert events == ["version:0", "gather:embed", "gather:head", "load:embed,head", "version:3", "reset_prefix_cache"]


def test_sleep_needs_sleep_mode_and_a_partial_wake_is_an_error(fake_vllm):
    events, build = fake_vllm
    with pytest.raises(RuntimeError, match="sleep_mode=True"):
        build(sleep_mode=False).sleep()
    engine = build(sleep_mode=True, wake_completes=False)
    engine.sleep()
    with pytest.raises(RuntimeError, match="still reports sleeping memory"):
        engine.push_weights(weights(events), version=1)


# -------------------------------------------------------------------------- transformers engine device
@pytest.mark.parametrize("cuda, local_rank, want", [(False, "3", "cpu"), (True, "3", "cuda:3"), (True, None, "cuda:0")])
def test_hf_engine_device(monkeypatch, cuda, local_rank, want):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert engine_device() == torch.device(want)


# ------------------------------------------------------------------------------ CUDA RNG in checkpoints
@pytest.fixture
def fake_cuda(monkeypatch):
    """Two fake devices whose RNG states are recorded when set."""
    states = [torch.arange(4, dtype=torch.uint8), torch.arange(4, 8, dtype=torch.uint8)]
    restored: list = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [s.clone() for s in states])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda new: restored.append([s.clone() for s in new]))
    return states, restored


def test_cuda_rng_states_are_saved_and_restored(fake_cuda, tmp_path):
    states, restored = fake_cuda
    torch.save(checkpoint.rng_state(), tmp_path / "rng.pt")  # what save() writes
    expected = (np.random.rand(), torch.rand(3))
    checkpoint.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=False))
    assert len(restored) == 1 and all(torch.equal(a, b) for a, b in zip(restored[0], states, strict=True))
    again = (np.random.rand(), torch.rand(3))
    assert expected[0] == again[0] and torch.equal(expected[1], again[1])


def test_cuda_rng_states_for_another_device_count_are_skipped_with_a_warning(fake_cuda, monkeypatch, caplog):
    _, restored = fake_cuda
    state = checkpoint.rng_state()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    checkpoint.set_rng_state(state)
    assert restored == []
    assert "CUDA RNG states for 2 devices, this process sees 1" in caplog.text


def test_cpu_checkpoint_has_no_cuda_state_and_loads_on_gpu(fake_cuda, monkeypatch, tmp_path):
    """A checkpoint written on CPU (before CUDA states existed, or on a CPU machine) resumes on a GPU one:
    the CUDA generators keep their seeded state."""
    _, restored = fake_cuda
    with monkeypatch.context() as cpu:
        cpu.setattr(torch.cuda, "is_available", lambda: False)
        assert "cuda" not in checkpoint.rng_state()
        torch.save(checkpoint.rng_state(), tmp_path / "rng_rank0.pt")
    expected = torch.rand(3)
    monkeypatch.setattr(checkpoint.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(checkpoint.dist, "get_world_size", lambda: 1)
    actor = types.SimpleNamespace(deepspeed=types.SimpleNamespace(load_checkpoint=lambda *a, **k: ("ok", {})),
                                  cfg=types.SimpleNamespace(model=types.SimpleNamespace(lora=None)))
    checkpoint.load(actor, tmp_path, 1, tmp_path)  # written by 1 rank, loaded by 1
    assert torch.equal(torch.rand(3), expected)
    assert restored == []


# ---------------------------------------------------------------------------- one build per filesystem
BUILD = """
import hashlib, logging, os, sys, time
from pathlib import Path
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
from gapo.models import resolve_model
gate = Path(sys.argv[1])
(gate / f"ready-{os.getpid()}").touch()
while len(list(gate.glob("ready-*"))) < 2:  # both processes ask at the same moment
    time.sleep(0.01)
d = resolve_model("tiny-qwen2")
h = hashlib.sha256()
for f in sorted(p for p in d.rglob("*") if p.is_file()):
    h.update(f.relative_to(d).as_posix().encode() + f.read_bytes())
print(d, h.hexdigest())
"""


@pytest.fixture(scope="module")
def concurrent_build(tmp_path_factory):
    cache, gate = tmp_path_factory.mktemp("cache"), tmp_path_factory.mktemp("gate")
    env = {**os.environ, "GAPO_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", BUILD, str(gate)], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    results = [(*p.communicate(timeout=600), p.returncode) for p in procs]
    return cache, results


@pytest.mark.dist
def test_a_model_built_inside_rank_1_of_a_process_group_is_whole(torchrun, tmp_path):
    """The ranks of a run build a built-in model on first use, whichever gets there first; transformers 5 saves
    models only on rank 0 of an initialised process group, so rank 1's build must not run inside its rank."""
    rank0, rank1 = torchrun("dist_build_check.py", str(tmp_path / "cache"), nproc=2, timeout=300)
    assert rank0["files"] == []
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(rank1["files"]), rank1


@pytest.mark.e2e
def test_two_processes_build_a_builtin_model_once(concurrent_build):
    cache, results = concurrent_build
    for _, err, code in results:
        assert code == 0, err[-3000:]
    seen = [out.strip().splitlines()[-1] for out, _, _ in results]  # (libraries print above it)
    assert seen[0] == seen[1]  # same directory, same bytes seen by both
    builds = sum(err.count("gapo.models: building") for _, err, _ in results)
    assert builds == 1, [err for _, err, _ in results]
    models = cache / "models"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (models / "tiny-qwen2").iterdir()}
    assert not list(models.glob(".tiny-qwen2-*")), "a temporary build directory was left behind"


@pytest.mark.e2e
def test_hf_engine_runs_on_the_cpu_without_cuda(concurrent_build):
    model_dir = concurrent_build[0] / "models" / "tiny-qwen2"
    engine = HFEngine(str(model_dir))
    assert engine.device == torch.device("cpu")
    before = engine.generate([[1, 2, 3]], SAMPLING, seeds=[5])
    receipt = engine.push_weights(((name, p.detach().clone()) for name, p in engine.model.named_parameters()),
                                  version=1)
    assert receipt.unloaded == ["lm_head.weight"]  # tied: named_parameters() gave it under the embedding's name
    after = engine.generate([[1, 2, 3]], SAMPLING, seeds=[5])
    assert after[0][0].version == 1 and [[(x.response_ids, x.logprobs) for x in g] for g in after] == \
        [[(x.response_ids, x.logprobs) for x in g] for g in before]


def test_a_build_keeps_its_seeds_to_itself_and_refuses_a_foreign_directory(tmp_path):
    from gapo.models import _atomic_build

    def build(out: Path) -> None:
        torch.manual_seed(0)
        (out / "config.json").write_text("{}")

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    _atomic_build(tmp_path / "m", build)
    assert torch.equal(torch.rand(3), expected)
    assert (tmp_path / "m" / "config.json").is_file()
    (tmp_path / "half").mkdir()
    with pytest.raises(ConfigError, match="holds no config.json"):
        _atomic_build(tmp_path / "half", build)


def test_a_prefix_cache_that_will_not_reset_stops_the_push(fake_vllm):
    """vLLM answers False, with only a warning, when it cannot reset its prefix cache; the next step would then
    reuse the old weights' prompt KV. The push must fail loudly instead."""
    events, build = fake_vllm
    engine = build(False)
    FakeLLM.reset_ok = False
    try:
        with pytest.raises(RuntimeError, match="did not reset its prefix cache"):
            engine.push_weights([("w", torch.zeros(1))], version=1)
    finally:
        FakeLLM.reset_ok = True
    assert events[-1] == "reset_prefix_cache"


@pytest.mark.dist
def test_collectives_time_out_as_configured_and_unshared_run_dirs_are_refused(torchrun, tmp_path):
    """trainer.collective_timeout_min reaches the process group (a 3 s timeout gives up on a rank 8 s late, instead
    of DeepSpeed's 10 minutes), and a run directory rank 1 cannot see is refused on both ranks before training."""
    res = torchrun("dist_infra_check.py", str(tmp_path), nproc=2, timeout=120)
    assert all("rank(s) 1 cannot see a file rank 0 wrote there" in r["unshared"] for r in res), res
    assert res[0]["probe_left"] == [] and res[1]["probe_left"] == []
    assert res[0]["late_barrier"] != "returned" and res[0]["waited_s"] < 7, res[0]


# ------------------------------------------------------------------------------------ NCCL start, N -> 1 reshard
def test_each_rank_binds_its_gpu_before_the_process_group_exists(monkeypatch):
    """All_gather_object stages its tensor on the current CUDA device: unless LOCAL_RANK's device is current before
    the first collective, ranks 1.. hand NCCL a cuda:0 tensor for a group bound to cuda:LOCAL_RANK."""
    import deepspeed

    from gapo import distributed

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kw: calls.append(("init", kw["dist_backend"])))
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 3)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 4)
    for key, value in {"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(key, value)
    placement = distributed.init_distributed()
    assert (placement.rank, placement.world) == (3, 4)
    assert calls == [("set_device", 3), ("init", "nccl")]


def test_a_reshard_onto_one_rank_places_adams_moments_with_their_parameters(tmp_path):
    """N -> 1: the universal layout is read to the CPU; every optimizer tensor must end on its parameter's device
    (cuda:0 on a GPU, where AdamW refuses a CPU moment at its first step). The meta device stands in for the GPU."""
    model = torch.nn.Linear(3, 2, device="meta")
    zero = tmp_path / "zero"
    for name, p in model.named_parameters():
        (zero / name).mkdir(parents=True)
        for key in ["fp32", "exp_avg", "exp_avg_sq"]:  # stage 3 writes them flat
            torch.save(torch.ones(p.numel()), zero / name / f"{key}.pt")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.save({"optimizer_state_dict": {"state": {0: {"step": 5}}, "param_groups": [{"lr": 2e-3, "params": [0]}]}},
               zero / "optimizer_state.pt")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    torch.save({"lr_scheduler": scheduler.state_dict(), "global_steps": 5, "global_samples": 40, "skipped_steps": 0},
               tmp_path / "mp_rank_00_model_states.pt")
    engine = types.SimpleNamespace(module=model, optimizer=optimizer)
    reshard._universal_to_stage0(types.SimpleNamespace(deepspeed=engine, scheduler=scheduler), tmp_path)
    for p in model.parameters():
        state = optimizer.state[p]
        assert state["exp_avg"].device == state["exp_avg_sq"].device == p.device == torch.device("meta")
        assert state["exp_avg"].shape == p.shape
    assert engine.global_steps == 5 and optimizer.param_groups[0]["lr"] == 2e-3


# ------------------------------------------------------------------------------------ GQA through the pinned kernel
@pytest.mark.parametrize("share", [False, True])
def test_an_unpadded_gqa_micro_batch_reaches_sdpa_with_every_head(monkeypatch, share):
    """CUDA's memory-efficient kernel (pinned for both passes) has no GQA: SDPA must get K/V repeated to the query
    heads and no enable_gqa, also when a micro-batch has no padding and transformers drops its mask. The actor's
    attention function is the one the GPU runs; the log-probs equal transformers' own SDPA attention."""
    from transformers import AutoModelForCausalLM

    from gapo.models import resolve_model
    from gapo.trainer.actor import Policy, register_attention
    from gapo.trainer.logprobs import MicroBatch

    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(query, key, value, **kwargs):
        calls.append((query.shape[1], key.shape[1], value.shape[1], kwargs.get("enable_gqa", False)))
        return sdpa(query, key, value, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    path = resolve_model("tiny-qwen2")  # 4 query heads, 2 KV heads
    ours = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation=register_attention())
    stock = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="sdpa")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 300, (6,), generator=g).tolist()
    mb = MicroBatch.pack([prompt, prompt], [torch.randint(3, 300, (5,), generator=g).tolist() for _ in range(2)],
                         pad_id=0, share_prompts=share)
    assert bool(mb.attention_mask.all())  # no padding: the case that failed on CUDA
    with torch.no_grad():
        got, _ = Policy(ours)(mb, 0.8)
        assert calls and all(q == k == v and not gqa for q, k, v, gqa in calls), calls
        calls.clear()
        want, _ = Policy(stock)(mb, 0.8)
    assert any(gqa for *_, gqa in calls)  # transformers' own path asks for GQA here: the test sees the case
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
