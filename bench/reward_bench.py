"""Rewarder throughput: math verifications/s and sandboxed code executions/s, with 1 and 2 workers.

    .venv/bin/python bench/reward_bench.py [--data DIR] [--code-items N] [--math-passes P]

Math: every MATH500 gold answer, as the response "The answer is $\\boxed{<gold>}$.", scored against
itself through MathVerifier (real math-verify worker processes). Code: every LeetCode reference solution
run in the sandbox against its check() program through CodeRunner. Both pools are started and warmed
before timing, so the figures are steady-state throughput, not start-up. The 1- and 2-worker figures come
from the same run on the same machine, so their ratio is meaningful even when absolute numbers are not
(other jobs may share the CPUs). Figures are printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from gapo.reward.code import CodeRunner
from gapo.reward.math import MathVerifier
from gapo.reward.sandbox import namespaces_available


def _default_data_dir() -> Path:
    return Path(os.environ.get("GAPO_DATA_DIR") or Path(__file__).resolve().parents[1].parent / "shared" / "data")


def bench_math(items: list[dict], workers: int, passes: int) -> tuple[float, int]:
    groups = [([f"The answer is $\\boxed{{{x['answer']}}}$."], x["answer"]) for x in items]
    with MathVerifier(num_workers=workers, timeout_s=10.0) as verifier:
        verifier.score_batch(groups[: 4 * workers])  # start and warm every worker
        start = time.perf_counter()
        correct = 0
        for _ in range(passes):
            correct += sum(row[0].status == "correct" for row in verifier.score_batch(groups))
        elapsed = time.perf_counter() - start
    return passes * len(groups) / elapsed, correct


def bench_code(items: list[dict], workers: int) -> tuple[float, int]:
    groups = [([f"```python\n{x['solutions']}\n```"], x["tests"]) for x in items]
    with CodeRunner(num_workers=workers, timeout_s=10.0) as runner:
        runner.score_batch(groups[:workers])  # warm-up
        start = time.perf_counter()
        results = runner.score_batch(groups)
        elapsed = time.perf_counter() - start
    return len(groups) / elapsed, sum(row[0].status == "correct" for row in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=_default_data_dir(), help="the shared data directory")
    parser.add_argument("--code-items", type=int, default=200, help="how many LeetCode items to run")
    parser.add_argument("--math-passes", type=int, default=2, help="passes over MATH500 per worker count")
    args = parser.parse_args()
    math_items = json.loads((args.data / "math" / "math500.json").read_text())
    code_items = json.loads((args.data / "code" / "leetcode.json").read_text())[: args.code_items]

    figures = {}
    for workers in (1, 2):
        rate, correct = bench_math(math_items, workers, args.math_passes)
        figures[("math", workers)] = rate
        print(f"math, {workers} worker(s): {correct}/{args.math_passes * len(math_items)} correct", flush=True)
    for workers in (1, 2):
        rate, correct = bench_code(code_items, workers)
        figures[("code", workers)] = rate
        print(f"code, {workers} worker(s): {correct}/{len(code_items)} reference solutions passed", flush=True)

    print()
    print(f"machine: {os.cpu_count()} CPUs; sandbox isolation: "
          f"{'namespaces' if namespaces_available() else 'NONE (fallback)'}")
    print(f"math verifications/s (MATH500 gold as boxed responses, {len(math_items)} x {args.math_passes}): "
          f"1 worker {figures[('math', 1)]:.0f}, 2 workers {figures[('math', 2)]:.0f}, "
          f"ratio {figures[('math', 2)] / figures[('math', 1)]:.2f}")
    print(f"code sandboxed executions/s (LeetCode reference solutions, {len(code_items)}): "
          f"1 worker {figures[('code', 1)]:.1f}, 2 workers {figures[('code', 2)]:.1f}, "
          f"ratio {figures[('code', 2)] / figures[('code', 1)]:.2f}")


if __name__ == "__main__":
    main()
