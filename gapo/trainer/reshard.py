"""Resuming on another number of ranks: a checkpoint's ZeRO state re-cut for this run's ranks, through
DeepSpeed's universal checkpoint (gapo/trainer/checkpoint.py loads a checkpoint and calls this when the numbers of
ranks differ).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from gapo.distributed import rank0_decides
from gapo.errors import ConfigError

# Resuming on another number of ranks. A ZeRO checkpoint holds each rank's slice of the flat fp32 weights and
# Adam moments; DeepSpeed's universal checkpoint (deepspeed.checkpoint.ds_to_universal) re-assembles them one
# folder per parameter (zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt, zero/optimizer_state.pt with the step and the
# hyper-parameters, and the model-states files with the LR schedule), from which a DeepSpeed engine built with
# checkpoint.load_universal cuts its own slices. DeepSpeed has no such path at stage 0 (one rank in fp32, see
# Config.zero_stage), so that side of the conversion is written here: the same folder layout from and into a
# plain torch AdamW.
RESHARD = ".reshard"  # in the run directory: the universal form of the checkpoint being loaded, removed once read


def reshard(actor, ckpt: Path, saved_world: int, saved_stage: int, scratch: Path) -> None:
    """Collective. Loads `ckpt` (written by `saved_world` ranks at ZeRO stage `saved_stage`) into the run's DeepSpeed
    engine: model, Adam moments and step, LR schedule. Rank 0 converts it once into `scratch`; every rank then reads
    its own slices."""
    rank = dist.get_rank()
    universal = scratch / ckpt.name

    def convert() -> None:
        tmp = scratch / f".tmp-{ckpt.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(universal, ignore_errors=True)
        try:
            if saved_stage == 0:
                names = [n for n, _ in actor.deepspeed.module.named_parameters()]
                _stage0_to_universal(ckpt / "ds" / "state", tmp, names)
            else:
                from argparse import Namespace

                from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

                # inject_missing_state: stages 1-2 need a version tag that only Megatron-DeepSpeed writes
                ds_to_universal(Namespace(input_folder=str(ckpt / "ds" / "state"), output_folder=str(tmp),
                                          num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                                          strict=True, inject_missing_state=True))
        except Exception as err:  # DeepSpeed's converter asserts on what it cannot read; named, then stopped
            shutil.rmtree(tmp, ignore_errors=True)
            raise ConfigError(f"checkpoint {ckpt}: written by {saved_world} ranks (ZeRO stage {saved_stage}), it "
                              f"could not be converted for {dist.get_world_size()} ranks "
                              f"({type(err).__name__}: {err}); resume it with --nproc {saved_world}") from None
        _universal_for(tmp, actor.zero_stage, dict(actor.deepspeed.module.named_parameters()))
        os.replace(tmp, universal)

    rank0_decides(convert, rank)
    if actor.zero_stage == 0:
        _universal_to_stage0(actor, universal)
    else:
        path, _ = actor.deepspeed.load_checkpoint(str(scratch), tag=universal.name, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        if path is None:
            raise ConfigError(f"checkpoint {ckpt}: DeepSpeed could not load its universal form {universal}")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(scratch)


def _universal_for(folder: Path, stage: int, params: dict[str, Tensor]) -> None:
    """DeepSpeed 0.19.8's converter writes what its reader for the *same* family of stages reads: stage 3 flat
    tensors with the Adam step in zero/optimizer_state.pt, stages 1-2 {"param": shaped tensor} files with the
    step in each parameter's folder (and optimizer_state.pt without it). Both forms are completed here, so that
    any stage reads what any stage wrote; the model-states file goes under both of the names the readers use."""
    zero = folder / "zero"
    opt = torch.load(zero / "optimizer_state.pt", weights_only=False)
    if "optimizer_state_dict" not in opt:  # written from stages 1-2: the step is in every parameter's folder
        step = torch.load(zero / next(iter(params)) / "step.pt", weights_only=False)
        opt["optimizer_state_dict"] = {"state": {0: {"step": step}}, "param_groups": opt["param_groups"]}
        torch.save(opt, zero / "optimizer_state.pt")
    step = opt["optimizer_state_dict"]["state"][0]["step"]
    if stage in (1, 2):
        for name, param in params.items():
            for f in (zero / name).glob("*.pt"):
                value = torch.load(f, map_location="cpu", weights_only=False)
                if f.stem != "step" and not isinstance(value, dict):
                    torch.save({"param": value.reshape(param.shape)}, f)
            if not (zero / name / "step.pt").exists():
                torch.save(step, zero / name / "step.pt")
    states = sorted(folder.glob("*model_states.pt"))[0]
    for name in ["zero_pp_rank_0_mp_rank_00_model_states.pt", "mp_rank_00_model_states.pt"]:
        if not (folder / name).exists():
            shutil.copyfile(states, folder / name)


def _stage0_to_universal(src: Path, out: Path, names: list[str]) -> None:
    """A stage-0 checkpoint (the torch AdamW state inside the model-states file, by parameter index in
    `names`' order) in the universal layout."""
    states = torch.load(src / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    module, opt = states.pop("module"), states.pop("optimizer")
    for i, name in enumerate(names):
        folder = out / "zero" / name
        folder.mkdir(parents=True)
        weight = module[name].float()
        moments = opt["state"].get(i, {})  # a parameter that has had no step yet has no moments
        for key, value in [("fp32", weight), ("exp_avg", moments.get("exp_avg", torch.zeros_like(weight))),
                           ("exp_avg_sq", moments.get("exp_avg_sq", torch.zeros_like(weight)))]:
            torch.save(value.reshape(-1).clone(), folder / f"{key}.pt")
    step = next((s["step"] for s in opt["state"].values()), torch.tensor(0.0))
    torch.save({"optimizer_state_dict": {"state": {0: {"step": step}}, "param_groups": opt["param_groups"]},
                "param_groups": opt["param_groups"]}, out / "zero" / "optimizer_state.pt")
    torch.save(states, out / "mp_rank_00_model_states.pt")


def _universal_tensor(path: Path, like: Tensor) -> Tensor:
    """One tensor of the universal layout shaped, typed and placed like `like`: AdamW refuses moments on another
    device than their parameter, and files are read to the CPU (on a GPU the parameter is on cuda:LOCAL_RANK)."""
    value = torch.load(path, map_location="cpu", weights_only=False)
    value = value["param"] if isinstance(value, dict) else value  # stages 1-2 write {"param": ...}, stage 3 flat
    return value.reshape(like.shape).to(device=like.device, dtype=like.dtype)


def _universal_to_stage0(actor, universal: Path) -> None:
    """The universal layout into a stage-0 DeepSpeed engine: weights, the torch AdamW's moments, step and
    hyper-parameters, the LR schedule and DeepSpeed's step counters."""
    opt_state = torch.load(universal / "zero" / "optimizer_state.pt", weights_only=False)["optimizer_state_dict"]
    step = opt_state["state"][0]["step"]
    optimizer = actor.deepspeed.optimizer
    for name, param in actor.deepspeed.module.named_parameters():
        fp32, exp_avg, exp_avg_sq = (_universal_tensor(universal / "zero" / name / f"{key}.pt", param)
                                     for key in ["fp32", "exp_avg", "exp_avg_sq"])
        with torch.no_grad():
            param.copy_(fp32)
        optimizer.state[param] = {"step": torch.as_tensor(step, dtype=torch.float32).clone(),
                                  "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    hyper = {k: v for k, v in opt_state["param_groups"][0].items() if k != "params"}
    for group in optimizer.param_groups:
        group.update(hyper)
    states = torch.load(universal / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    actor.scheduler.load_state_dict(states["lr_scheduler"])
    for key in ["global_steps", "global_samples", "skipped_steps"]:
        setattr(actor.deepspeed, key, states[key])
