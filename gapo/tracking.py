"""metrics.jsonl in the run directory, and the same numbers to wandb (offline unless asked otherwise).

Only rank 0 writes. The jsonl file is the source of truth for `gapo-plot`; wandb is for people who
already live there. wandb runs offline by default so that no run ever waits on the network.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from gapo import rundir
from gapo.config import Config
from gapo.configfile import dump_config


class Tracker:
    def __init__(self, cfg: Config, run_dir: Path, *, wandb_id: str | None = None, parent: dict | None = None):
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = run_dir / f"{rundir.CONFIG}.tmp"
        tmp.write_text(dump_config(cfg))
        os.replace(tmp, run_dir / rundir.CONFIG)
        self.file = open(run_dir / rundir.METRICS, "a")  # noqa: SIM115 - closed in finish()
        self.wandb = None
        if cfg.tracking.wandb and cfg.tracking.mode != "disabled":
            import wandb

            config = {**cfg.model_dump(mode="json"), "parent": parent}
            notes = f"branched from {parent['run_dir']} at step {parent['step']}" if parent else None
            self.wandb = wandb.init(project=cfg.tracking.project, name=cfg.tracking.run_name or run_dir.name,
                                    tags=cfg.tracking.tags + (["branch"] if parent else []), config=config,
                                    notes=notes, dir=str(run_dir), mode=cfg.tracking.mode, id=wandb_id,
                                    resume="allow")

    @property
    def wandb_id(self) -> str | None:
        return self.wandb.id if self.wandb else None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
        self.file.write(json.dumps({"step": step, **clean}) + "\n")
        self.file.flush()
        if self.wandb:
            self.wandb.log({k: v for k, v in metrics.items()}, step=step)

    def log_rollouts(self, records: list[dict]) -> None:
        with open(self.run_dir / rundir.ROLLOUTS, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)

    def finish(self) -> None:
        self.file.close()
        if self.wandb:
            self.wandb.finish()
