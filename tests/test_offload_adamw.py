"""The actor's AdamW with an offloaded optimizer is torch's fused CPU kernel (no full-size temporaries at the step,
gapo/trainer/actor.py `adamw`): it must update like the single-tensor AdamW it replaced, and stay deterministic and
exact across a save / load of its state (a resumed run continues bit for bit)."""

import pytest
import torch

from gapo.configfile import resolve
from gapo.trainer.actor import adamw

SHAPES = [(300, 40), (40,), (7, 5, 3)]


def trainer(offload: str, weight_decay: float = 0.1):
    return resolve({"trainer": {"lr": 1e-2, "weight_decay": weight_decay, "adam_betas": [0.9, 0.95],
                                "offload": {"optimizer": offload}}}).trainer


def params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def run(opt: torch.optim.Optimizer, ps: list[torch.nn.Parameter], steps: range) -> None:
    for k in steps:
        g = torch.Generator().manual_seed(100 + k)  # the same gradients for every optimizer, step by step
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g) * (1 + k)
        opt.step()


def test_the_offloaded_optimizer_is_fused_and_the_other_is_torchs_default():
    ps = params()
    assert adamw(ps, trainer("cpu")).defaults["fused"] is True
    default = adamw(ps, trainer("none")).defaults
    assert default["fused"] is None and default["foreach"] is None  # foreach on CUDA, single-tensor on CPU
    assert adamw(ps, trainer("cpu")).defaults["lr"] == 1e-2


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_fused_adamw_updates_like_the_single_tensor_one(weight_decay):
    fused, single = params(), params()
    opt_fused = adamw(fused, trainer("cpu", weight_decay))
    opt_single = torch.optim.AdamW(single, lr=1e-2, betas=(0.9, 0.95), weight_decay=weight_decay, foreach=False)
    start = [p.detach().clone() for p in fused]
    run(opt_fused, fused, range(5))
    run(opt_single, single, range(5))
    for a, b, s in zip(fused, single, start, strict=True):
        assert (a - s).abs().max() > 1e-3  # the weights moved: the comparison below can fail
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    for a, b in zip(opt_fused.state.values(), opt_single.state.values(), strict=True):
        torch.testing.assert_close(a["exp_avg"], b["exp_avg"], rtol=0, atol=1e-6)
        torch.testing.assert_close(a["exp_avg_sq"], b["exp_avg_sq"], rtol=1e-6, atol=0)
        assert float(a["step"]) == float(b["step"]) == 5


def test_fused_adamw_is_deterministic_and_resumes_exactly():
    straight = params()
    opt = adamw(straight, trainer("cpu"))
    run(opt, straight, range(6))

    again = params()
    run(adamw(again, trainer("cpu")), again, range(6))
    assert all(torch.equal(a, b) for a, b in zip(straight, again, strict=True))

    first = params()
    opt_first = adamw(first, trainer("cpu"))
    run(opt_first, first, range(3))
    saved = {"params": [p.detach().clone() for p in first], "opt": opt_first.state_dict()}
    resumed = [torch.nn.Parameter(p) for p in saved["params"]]
    opt_resumed = adamw(resumed, trainer("cpu"))
    opt_resumed.load_state_dict(saved["opt"])
    run(opt_resumed, resumed, range(3, 6))
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed, strict=True))
