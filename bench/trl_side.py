"""TRL's half of bench/e2e_vs_trl.py; runs in the benchmark environment (`make bench-env`), not in gapo's.

    .bench-venv/bin/python bench/trl_side.py --work DIR   (DIR/setup.json is written by e2e_vs_trl.py)

GRPOTrainer with TRL's own generation (transformers `generate`, TRL's default without a vLLM server),
the GSPO loss (sequence-level IS, token-mean over the accumulated batch), the same model, prompts, group
size, lengths, learning rate and optimizer steps per generation batch as the gapo side. Prints one JSON line:
the wall-clock seconds of every generation batch (= one gapo step).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer


def last_number_reward(completions: list[str], answer: list[str], **_) -> list[float]:
    """1 if the boxed answer (else the last number) equals the gold one: the gapo side's rule
    (math-verify + `reward.math_last_number_fallback`) on these integer answers."""
    out = []
    for text, gold in zip(completions, answer, strict=True):
        boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
        nums = re.findall(r"-?\d+(?:\.\d+)?", boxed[-1] if boxed else text)
        out.append(float(bool(nums) and float(nums[-1]) == float(gold)))
    return out


class StepClock(TrainerCallback):
    def __init__(self):
        self.marks: list[float] = []

    def on_train_begin(self, args, state, control, **kw):
        self.marks.append(time.perf_counter())

    def on_step_end(self, args, state, control, **kw):
        self.marks.append(time.perf_counter())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    work = Path(ap.parse_args().work)
    setup = json.loads((work / "setup.json").read_text())
    torch.manual_seed(setup["seed"])
    tok = AutoTokenizer.from_pretrained(setup["model_dir"])
    # The prompt text gapo builds (chat template + instruction), passed as plain text so both sides
    # tokenize exactly the same string.
    ds = Dataset.from_list([{"prompt": x["prompt_text"], "answer": x["answer"]} for x in setup["problems"]])
    opt_steps = setup["optimizer_steps_per_batch"]
    micro = setup["micro_batch_size"]
    mini = setup["prompts"] * setup["group_size"] // opt_steps
    args = GRPOConfig(
        output_dir=str(work / "trl_out"), use_cpu=True, bf16=False, seed=setup["seed"], report_to=[],
        save_strategy="no", logging_steps=1, disable_tqdm=True,
        learning_rate=setup["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, max_steps=setup["steps"] * opt_steps,
        per_device_train_batch_size=micro, gradient_accumulation_steps=mini // micro,
        steps_per_generation=setup["prompts"] * setup["group_size"] // micro,
        num_generations=setup["group_size"], max_completion_length=setup["max_new_tokens"],
        temperature=1.0, top_p=1.0, top_k=0, beta=0.0, num_iterations=1,
        loss_type="dapo", importance_sampling_level="sequence", epsilon=setup["eps"], epsilon_high=setup["eps"],
        scale_rewards="none",
    )
    clock = StepClock()
    trainer = GRPOTrainer(model=setup["model_dir"], reward_funcs=[last_number_reward], args=args, train_dataset=ds,
                          processing_class=tok, callbacks=[clock])
    trainer.train()
    m = clock.marks  # m[0] = start, m[i] = end of optimizer step i; a generation batch spans opt_steps of them
    batches = [m[i + opt_steps] - m[i] for i in range(0, len(m) - 1, opt_steps)]
    print(json.dumps({"batch_s": batches}))


if __name__ == "__main__":
    main()
