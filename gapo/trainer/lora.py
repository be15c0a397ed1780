"""LoRA on the actor: PEFT adapters on the frozen model, the merged weight the rollout engine gets, the bf16 forward
that computes with that very weight, and a checkpoint without the frozen base.

The actor (gapo/trainer/actor.py) calls `with_lora` on the loaded model and `save_without_frozen` on its DeepSpeed
engine; its push sends `merged_weight` of each adapted layer. docs/one-gpu.md, "LoRA", says why each choice.
"""

from __future__ import annotations

import types

import torch
from torch import Tensor

from gapo.errors import ConfigError


def with_lora(model: torch.nn.Module, lora) -> torch.nn.Module:
    """`model` with PEFT LoRA adapters on `lora.target_modules` (model.lora), everything else frozen. Returns the
    Hugging Face model itself, its targeted linear layers replaced in place by PEFT's (the PeftModel wrapper is not
    needed: the forward, names and export all go through the HF model). Only linear layers are accepted: the push
    merges B @ A into a weight, which is what a LoRA linear layer adds."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import Linear as LoraLinear

    peft_model = get_peft_model(model, LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                  target_modules=list(lora.target_modules), bias="none"))
    model = peft_model.base_model.model
    adapted = [n for n, m in model.named_modules() if hasattr(m, "lora_A")]
    if odd := [n for n in adapted if not isinstance(model.get_submodule(n), LoraLinear)]:
        raise ConfigError(f"model.lora.target_modules names layers that are not linear: {odd[:3]}; LoRA here adapts "
                         "linear layers only")
    if hasattr(model.get_output_embeddings(), "lora_A") and model.config.get_text_config().tie_word_embeddings:
        # merged, the head would no longer equal the embedding it is tied to, and the rollout engine keeps one
        raise ConfigError("model.lora.target_modules adapts the output head, which this model ties to its input "
                         "embedding: leave it out")
    if model.dtype != torch.float32:
        compute_with_merged_weights(model)
    return model


def merged_weight(layer: torch.nn.Module) -> Tensor:
    """A PEFT LoRA linear layer's weight with its adapter folded in: W + scale * B @ A (PEFT's own merge, computed
    in fp32 and cast to W's dtype). What the rollout engine gets, and in bf16 also what the trainer computes with
    (compute_with_merged_weights). The layer's parameters must be gathered (ZeRO-3)."""
    w = layer.base_layer.weight
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    delta = (b.float() @ a.float()) * layer.scaling["default"]
    return (w.float() + delta).to(w.dtype)


def compute_with_merged_weights(model: torch.nn.Module) -> None:
    """Make every LoRA layer of `model` compute with merged_weight, the very tensor the push sends, instead of PEFT's
    base(x) + scale * B(A(x)).

    Why: in bf16 the two round in different places (PEFT rounds Wx, the adapter's output and their sum; the merge
    rounds W + scale * B @ A once), so no merged weight equals PEFT's forward and the sampler would compute another
    policy than the trainer. Both drop an adapter update below about half a bf16 step, each in its own way (measured
    on tiny-qwen2: PEFT keeps no more of a small update than the merge). With this the trainer's policy is the
    rollout engine's, up to kernels, as in full bf16 fine-tuning, where the bf16 weights also lag the fp32 master copy.
    The gradient is LoRA's, taken at the merged weight (the rounding passed straight through); in fp32 the merge is
    exact to ~1e-7 and PEFT's forward is kept.

    Under ZeRO-3 the layer's forward no longer calls the modules that own its base weight and adapters, so they are
    registered as the layer's external parameters: DeepSpeed gathers them when the layer is called and again for its
    backward, where W' is recomputed (DeepSpeed would also register them on their first access in a forward; this
    does not rely on it). Not a z3 leaf module: DeepSpeed reduces a leaf's gradients once per call, and a forward that
    shares prompts calls every layer twice, which its gradient reduction refuses (measured: an assertion in stage3.py
    on the first backward of tiny_cpu in bf16 on 2 ranks)."""
    import deepspeed
    from peft.tuners.lora import Linear as LoraLinear

    for layer in [m for m in model.modules() if isinstance(m, LoraLinear)]:
        layer.forward = types.MethodType(_merged_forward, layer)
        for p in (layer.base_layer.weight, layer.base_layer.bias, layer.lora_A["default"].weight,
                  layer.lora_B["default"].weight):
            if p is not None:
                deepspeed.zero.register_external_parameter(layer, p)


def _merged_forward(layer: torch.nn.Module, x: Tensor, *args, **kwargs) -> Tensor:
    return _MergedLoraLinear.apply(x, layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer)


class _MergedLoraLinear(torch.autograd.Function):
    """y = x W'^T + bias with W' = merged_weight(layer); gradients to x, A and B (the base is frozen).

    W' is recomputed in backward rather than saved: saved, every adapted layer would hold a full copy of its weight
    from forward to backward, which under ZeRO-3 undoes the partitioning. The adapters' gradients are LoRA's
    low-rank products, scale * g^T (x A^T) and scale * (g B)^T x, never the full dL/dW' (one weight-sized GEMM more).
    """

    @staticmethod
    def forward(ctx, x: Tensor, a: Tensor, b: Tensor, layer: torch.nn.Module) -> Tensor:
        ctx.layer = layer
        ctx.save_for_backward(x, a, b)
        return torch.nn.functional.linear(x, merged_weight(layer), layer.base_layer.bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, a, b = ctx.saved_tensors
        scale = ctx.layer.scaling["default"]
        g, xs = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1]).to(grad.dtype)
        grad_x = grad @ merged_weight(ctx.layer).to(grad.dtype) if ctx.needs_input_grad[0] else None
        grad_a = ((g @ b.to(g.dtype)).T @ xs * scale).to(a.dtype) if ctx.needs_input_grad[1] else None
        grad_b = (g.T @ (xs @ a.to(g.dtype).T) * scale).to(b.dtype) if ctx.needs_input_grad[2] else None
        return grad_x, grad_a, grad_b, None


def save_without_frozen(engine) -> None:
    """Make a DeepSpeed engine's `module_state_dict(exclude_frozen_parameters=True)` leave out every name of a frozen
    tensor.

    A LoRA checkpoint leaves the frozen base out (checkpoint.save: exclude_frozen_parameters), but DeepSpeed finds
    frozen tensors by named_parameters(), which names a tied weight once: the tied head's alias (lm_head.weight, the
    whole embedding matrix) stayed in, 113 of the demo's 133 MB of module state (deepspeed 0.19.8 runtime/engine.py,
    module_state_dict)."""
    frozen = [n for n, p in engine.module.named_parameters(remove_duplicate=False) if not p.requires_grad]
    deepspeed_state_dict = engine.module_state_dict

    def state_dict_without_frozen(*args, exclude_frozen_parameters: bool = False, **kwargs) -> dict:
        sd = deepspeed_state_dict(*args, exclude_frozen_parameters=exclude_frozen_parameters, **kwargs)
        for name in frozen if exclude_frozen_parameters else ():
            sd.pop(name, None)
        return sd

    engine.module_state_dict = state_dict_without_frozen
