"""Run under torchrun by test_lora.py: in bf16 a LoRA layer computes with its merged weight (actor.py,
compute_with_merged_weights), a forward DeepSpeed does not see call the modules that own the weights. Is the adapters'
gradient through the ZeRO-3 actor (weights partitioned, prompts shared so that every layer runs twice per forward,
micro-batches over ranks) the one a plain torch backward gives? Writes one JSON result per rank. Device-agnostic:
bench/gpu/check.py runs it on a GPU (the references then run on the same device, the same kernels)."""

import sys

import torch
import torch.distributed as dist
from result import write_result

from gapo.configfile import resolve
from gapo.distributed import init_distributed, leave_distributed
from gapo.models import resolve_model
from gapo.trainer.actor import Actor
from gapo.trainer.lora import with_lora
from gapo.trainer.logprobs import MicroBatch, response_logprobs


def partitioning_every_weight() -> None:
    """DeepSpeed keeps parameters under 1e5 elements whole on every rank (stage3_param_persistence_threshold), and
    every weight of tiny-qwen2 is: the actor's own config would never partition a LoRA layer's weights here."""
    import deepspeed

    initialize = deepspeed.initialize

    def partitioned(*args, config, **kwargs):
        zero = {**config["zero_optimization"], "stage3_param_persistence_threshold": 0}
        return initialize(*args, config={**config, "zero_optimization": zero}, **kwargs)

    deepspeed.initialize = partitioned


def main(out_path: str, stage: int) -> None:
    import deepspeed

    partitioning_every_weight()
    torch.manual_seed(0)  # PEFT draws lora_A from torch's global generator: the same adapters on every run
    placement = init_distributed()
    rank, world = placement.rank, placement.world
    cfg = resolve({"model": {"path": "tiny-qwen2", "dtype": "bfloat16", "lora": {"rank": 4, "alpha": 8.0}},
                   "trainer": {"zero_stage": stage, "micro_batch_size": 2, "ppo_mini_batch_size": 8, "grad_clip": 1e9},
                   "rollout": {"prompts_per_step": 2, "group_size": 4}})
    model_dir = str(resolve_model("tiny-qwen2"))
    actor = Actor(cfg, model_dir)
    # B random (PEFT starts it at 0, where A gets no gradient), the same on every rank; then every adapter as the
    # torch reference will hold it
    adapters = {n: p for n, p in actor.module.named_parameters() if p.requires_grad}
    g = torch.Generator().manual_seed(0)
    with deepspeed.zero.GatheredParameters(list(adapters.values()), modifier_rank=0, enabled=actor.zero_stage == 3):
        for name, p in adapters.items():
            if ".lora_B." in name:
                p.data.copy_(torch.randn(p.shape, generator=g) * 1e-2)
    with deepspeed.zero.GatheredParameters(list(adapters.values()), enabled=actor.zero_stage == 3):
        start = {name: p.detach().clone() for name, p in adapters.items()}
    q = actor.module.get_submodule("model.layers.0.self_attn.q_proj")
    partitioned = [p.numel() == 0 for p in (q.base_layer.weight, q.lora_A["default"].weight)]

    micro = 8 // world // 2
    prompts = [[torch.randint(3, 300, (5,), generator=g).tolist()] * 2 if j % 2 == 0 else
               [torch.randint(3, 300, (5,), generator=g).tolist() for _ in range(2)] for j in range(4)]
    responses = [[torch.randint(3, 300, (6,), generator=g).tolist() for _ in range(2)] for _ in range(4)]
    mbs = [MicroBatch.pack(p, r, 0, share_prompts=True) for p, r in zip(prompts, responses, strict=True)]
    assert [mb.shared is not None for mb in mbs] == [True, False, True, False]
    tokens = sum(float(mb.resp_mask.sum()) for mb in mbs)
    for mb in mbs[rank * micro:(rank + 1) * micro]:
        mb = mb.to(actor.device)
        lp, _ = actor.deepspeed(mb, 1.0)
        actor.backward(-(lp * mb.resp_mask).sum() / tokens)
    ds_norm = actor.grad_norm()

    from transformers import AutoModelForCausalLM

    def reference_norm(dtype: torch.dtype) -> float:
        """bf16: the same merged forward, no DeepSpeed; fp32: PEFT's own forward (LoRA's gradient, unrounded)."""
        ref = with_lora(AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype), cfg.model.lora).to(actor.device)
        params = dict(ref.named_parameters())
        with torch.no_grad():
            for name, t in start.items():
                params[name].copy_(t)
        plain = [MicroBatch.pack(p, r, 0).to(actor.device) for p, r in zip(prompts, responses, strict=True)]
        total = sum(-(response_logprobs(ref.get_decoder(), ref.get_output_embeddings(), mb, 1.0)[0].float()
                      * mb.resp_mask).sum() for mb in plain) / tokens
        total.backward()
        return float(torch.sqrt(sum((params[n].grad.float() ** 2).sum() for n in start)))

    dist.barrier()
    write_result(out_path, rank, {"ds": ds_norm, "merged_bf16": reference_norm(torch.bfloat16),
                   "peft_fp32": reference_norm(torch.float32), "partitioned": partitioned,
                   "lora_layers_merged": sum(1 for m in actor.module.modules() if hasattr(m, "lora_A")
                                             and "_merged_forward" in repr(m.forward))})


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
    leave_distributed()
