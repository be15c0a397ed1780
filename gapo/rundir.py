"""The files of a run directory (trainer.output_dir), named once: the loop and the tracker write them;
checkpoint, rehearse, gapo-plot and gapo-compare read them.

    <output_dir>/
        config.yaml         the resolved config of the latest start
        metrics.jsonl       one JSON line per step and per validation: what gapo-plot and gapo-compare read
        rollouts.jsonl      every rollout with its clip decisions (trainer.log_rollouts)
        memory_plan.txt     the memory plan the run was checked against
        train.log           what the console leaves out
        val/step_N/         validation results at step N (gapo-eval's results.json and per_problem.jsonl)
        checkpoints/        see gapo/trainer/checkpoint.py
        rehearsal_config.yaml, rehearsal.md     a rehearsal's config and report (gapo-train --rehearse)
"""

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
ROLLOUTS = "rollouts.jsonl"
MEMORY_PLAN = "memory_plan.txt"
TRAIN_LOG = "train.log"
VAL = "val"
CHECKPOINTS = "checkpoints"
REHEARSAL_CONFIG = "rehearsal_config.yaml"
REHEARSAL_REPORT = "rehearsal.md"
