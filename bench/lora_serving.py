"""LoRA on the vLLM CPU engine: merged weights (gapo's push) vs vLLM serving the adapter (enable_lora), measured.

    python bench/lora_serving.py prepare DIR        # tiny-qwen2 + a rank-8 adapter with random B: DIR/{adapter,merged}
    python bench/lora_serving.py merged DIR         # engine on the merged model: generate time, log-probs
    python bench/lora_serving.py adapter DIR        # engine on the base with enable_lora + the adapter folder
    python bench/lora_serving.py compare DIR        # the two engines' log-probs of the same sampled tokens

One engine per process (vLLM's in-process engine). The batch is tiny_cpu.yaml's step: 4 prompts x 8 samples, 24
tokens. Why it matters: with enable_lora vLLM CPU turns compilation off, and vLLM 0.32's LoRARequest takes a folder
only (no tensors), so every step would write the adapter to disk and load it under a new id."""

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def prepare(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gapo.configfile import load_config
    from gapo.models import resolve_model
    from gapo.trainer.lora import with_lora

    base = resolve_model("tiny-qwen2")
    model = AutoModelForCausalLM.from_pretrained(base)
    from peft import get_peft_model_state_dict

    lora_cfg = load_config("configs/tiny_cpu.yaml", ["model.lora.rank=8"]).model.lora
    hf = with_lora(model, lora_cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05)
    (out / "adapter").mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    state = {k.replace(".default", ""): v.contiguous() for k, v in get_peft_model_state_dict(hf).items()}
    save_file({f"base_model.model.{k}": v for k, v in state.items()}, out / "adapter" / "adapter_model.safetensors")
    hf.peft_config["default"].save_pretrained(out / "adapter")
    for m in hf.modules():
        if hasattr(m, "merge") and hasattr(m, "lora_A"):
            m.merge()
    merged = {n.replace(".base_layer.", "."): p for n, p in hf.state_dict().items() if ".lora_" not in n}
    plain = AutoModelForCausalLM.from_pretrained(base)
    plain.load_state_dict(merged)
    plain.save_pretrained(out / "merged")
    AutoTokenizer.from_pretrained(base).save_pretrained(out / "merged")


def serve(out: Path, mode: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from gapo.models import resolve_model

    lora = mode == "adapter"
    tic = time.perf_counter()
    llm = LLM(model=str(resolve_model("tiny-qwen2") if lora else out / "merged"), dtype="float32", seed=0,
              logprobs_mode="processed_logprobs", max_model_len=512, enable_chunked_prefill=False,
              kv_cache_memory_bytes=2**28, enable_lora=lora, max_lora_rank=8, max_loras=1)
    start = time.perf_counter() - tic
    prompts = [{"prompt_token_ids": [1 + i, 7, 9, 11 + i]} for i in range(4)]
    params = SamplingParams(n=8, temperature=1.0, max_tokens=24, seed=1, logprobs=0, ignore_eos=True)
    times, load = [], []
    for step in range(1, 6):
        req = LoRARequest(f"step{step}", step, str(out / "adapter")) if lora else None
        tic = time.perf_counter()
        if lora:  # what a step would do: a new adapter id, loaded from the folder before sampling
            llm.llm_engine.add_lora(req)
            load.append(time.perf_counter() - tic)
        res = llm.generate(prompts, params, lora_request=req, use_tqdm=False)
        times.append(time.perf_counter() - tic)
    samples = [[list(c.token_ids), [next(iter(d.values())).logprob for d in c.logprobs]]
               for r in res for c in r.outputs]
    json.dump({"mode": mode, "start_s": start, "step_s": sorted(times)[2], "load_s": sorted(load)[2] if load else 0,
               "samples": samples}, open(out / f"{mode}.json", "w"))


def compare(out: Path) -> None:
    a, b = (json.load(open(out / f"{m}.json")) for m in ("merged", "adapter"))
    same = [(x, y) for x, y in zip(a["samples"], b["samples"], strict=True) if x[0] == y[0]]
    diffs = [abs(p - q) for x, y in same for p, q in zip(x[1], y[1], strict=True)]
    print(json.dumps({"start_s": [a["start_s"], b["start_s"]], "generate_s": [a["step_s"], b["step_s"]],
                      "adapter_load_s": b["load_s"], "same_tokens": f"{len(same)}/{len(a['samples'])}",
                      # no token sampled alike in both: no difference measured (null), not a difference of 0
                      "mean_abs_logprob_diff": sum(diffs) / len(diffs) if diffs else None}))


if __name__ == "__main__":
    what, folder = sys.argv[1], Path(sys.argv[2])
    {"prepare": prepare, "compare": compare}.get(what, lambda o: serve(o, what))(folder)
