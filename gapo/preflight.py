"""What gapo-train checks before torch, vLLM and DeepSpeed load (5-12 s on a laptop): each mistake that needs no model
is named within 2 s, with exit 2 and nothing written. The ranks check again what only they can (the checkpoint's files,
the memory plan, the context); everything here reads files and tables, and imports nothing heavy (tests/test_bad_input
holds it to that)."""

from __future__ import annotations

from pathlib import Path

from gapo import rundir
from gapo.config import Config
from gapo.data import load_training_set
from gapo.errors import check_writable
from gapo.evaluation import check_names
from gapo.models import local_model


def check_start(cfg: Config) -> None:
    """Raises the ConfigError a rank would raise 5-12 s later, for every check that needs no model."""
    t = cfg.trainer
    out = Path(t.output_dir)
    check_writable(out, "trainer.output_dir")
    if t.resume_from and t.resume_from != rundir.AUTO:
        rundir.find(t.resume_from)  # a run folder with a checkpoint, or a checkpoint
    elif not t.resume_from:
        rundir.refuse_taken(out)
    local_model(cfg.model.path)
    load_training_set(cfg.data, local_only=True)  # each record of each file, with its fields
    check_names(cfg)
