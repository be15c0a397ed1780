"""How long gapo-train takes to answer the mistakes a new user makes, each in a fresh process as typed.

    .venv/bin/python bench/mistakes.py [--reps 3]

Every mistake here needs no model, so gapo-train names it before torch, vLLM and DeepSpeed load (gapo/preflight.py):
exit 2, one message, nothing written. Before that check existed, a missing model folder, a record without its field,
`--nproc 3` for 4 prompts or `--resume` on an empty folder were told after the run header and the heavy imports,
5-12 s. Prints each mistake's median seconds to the message and the CPU. tests/test_bad_input.py runs the same list
and checks what must hold on any CPU: the exit code, the message, that no heavy library loaded, nothing written.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import _util

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "vllm", "deepspeed", "transformers")  # what takes the seconds
# Runs gapo-train's main in a fresh interpreter and reports which heavy libraries had loaded by the time it returned.
PROBE = ("import json, sys\nfrom gapo.cli import train_main\ncode = train_main(json.loads(sys.argv[1]))\n"
         f"print(json.dumps({{'code': code, 'loaded': [m for m in {HEAVY!r} if m in sys.modules]}}))\n")


@dataclass(frozen=True)
class Mistake:
    name: str
    argv: list[str]  # gapo-train's arguments; the run's folder is always <root>/out
    said: str  # in the message


def mistakes(root: Path) -> list[Mistake]:
    """The cases, with their files written under `root` (the run's own folder, root/out, is never made)."""
    (root / "afile").write_text("")
    (root / "empty").mkdir(exist_ok=True)
    (root / "nofield.jsonl").write_text('{"problem": "1+1?", "answer": "2"}\n\n{"question": "2+2?", "answer": "4"}\n')
    (root / "noanswer.jsonl").write_text('{"problem": "1+1?", "solution": "2"}\n')
    (root / "bad_plugin.py").write_text("def (:\n")
    taken = root / "taken"
    taken.mkdir(exist_ok=True)
    (taken / "metrics.jsonl").write_text('{"step": 1}\n')
    out = f"trainer.output_dir={root / 'out'}"
    cases = [
        ("output folder under a file", [f"trainer.output_dir={root / 'afile' / 'run'}"], "a file is in the way"),
        ("output folder not writable", ["trainer.output_dir=/proc/gapo-no/run"], "cannot write into /proc"),
        ("record without the prompt field", [out, f"data.train={root / 'nofield.jsonl'}"],
         "nofield.jsonl: line 3 has no field 'problem'"),
        ("no record has the answer field", [out, f"data.train={root / 'noanswer.jsonl'}"],
         "no record has the field 'answer'"),
        ("missing model folder", [out, f"model.path={root / 'nomodel'}"], "is neither a directory nor a built-in"),
        ("--nproc that does not divide the batch", [out, "--nproc", "3"],
         "--nproc 3: rollout.prompts_per_step=4 must be divisible by the 3 ranks"),
        ("--resume on an empty folder", [out, "--resume", str(root / "empty")], "`--resume auto`"),
        ("a fresh run into a run's folder", [f"trainer.output_dir={taken}"], "already holds a run"),
        ("misspelt config", ["--config", "tiny-cpu", out], "did you mean tiny_cpu?"),
        ("misspelt key", [out, "trainer.totl_steps=3"], "did you mean trainer.total_steps"),
        ("a plugin that does not parse", [out, f"plugins=[{root / 'bad_plugin.py'}]"], "invalid syntax"),
        ("a benchmark file that is not there", [out, f"eval.benchmarks=[mine={root / 'none.jsonl'}]"], "no file"),
        ("unknown rewarder", [out, "data.type=nosuch"], "data.type='nosuch': no rewarder"),
    ]
    return [Mistake(name, (argv if "--config" in argv else ["--config", "tiny_cpu", *argv]), said)
            for name, argv, said in cases]


def answer(m: Mistake, root: Path) -> tuple[dict, str, float]:
    """(the probe's report, stderr, seconds from start to exit) of one mistake in a fresh process."""
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-", json.dumps(m.argv)], input=PROBE, cwd=root, capture_output=True,
                       text=True, timeout=300)
    took = time.perf_counter() - start
    return json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else {}, r.stderr, took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    print(_util.cpu_line())
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        print(f"{'mistake':42s} {'exit':>4s} {'s (median)':>10s}  message")
        for m in mistakes(root):
            runs = [answer(m, root) for _ in range(args.reps)]
            got, err, _ = runs[0]
            ok = got.get("code") == 2 and m.said in err and not got.get("loaded")
            line = err.strip().splitlines()[-1] if err.strip() else ""
            print(f"{m.name:42s} {got.get('code', '?')!s:>4s} {_util.median([t for *_, t in runs]):10.2f}  "
                  f"{'' if ok else 'NOT AS EXPECTED: '}{line[:90]}")


if __name__ == "__main__":
    main()
