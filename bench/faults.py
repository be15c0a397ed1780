"""The fault campaign: a signal to a random process of a run at a random moment, the documented recovery, and the end
compared with an uninterrupted run of the same command.

    .venv/bin/python bench/faults.py --seed 0 --trials 30         # the campaign (docs/testing.md has its table)
    .venv/bin/python bench/faults.py --trial train2:torchrun:SIGKILL:12.0   # one trial, as the table prints it

Scenarios (each with its uninterrupted reference, run once):
  train1   gapo-train, tiny_cpu, 1 rank, 3 steps, a checkpoint per step: launcher (the rank), math worker
  train2   the same on 2 ranks: launcher, torchrun (gapo.launch), rank, math worker
  sweep    gapo-sweep --run then --eval of a one-run manifest: sweep driver, launcher, math worker, evaluation
  code     the code rewarder scoring 6 programs of ~1 s each: sandbox harness, the program
  slurm    the SLURM chain: SKIP unless a SLURM controller answers (tests/test_cluster.py runs it under a real one)
Signals: SIGKILL, SIGTERM, SIGINT, SIGSTOP (then SIGCONT 1-5 s later: a suspended job resumed). The recovery is the
documented one: `--resume auto` (gapo-train), the same command again (gapo-sweep), none for a rewarder (a host fault
is named in the rollout and the step's metrics, reward/host_fault_frac).

Each trial is one class, the first that applies:
  hang       the command did not end within 4x the reference's time + 60 s
  leak       a process of the trial alive 2 s after the command ended
  traceback  a Python traceback on the console for a fault the user did not cause (Ctrl-C to the command is theirs)
  exit       an exit code outside gapo.errors.Exit (docs/commands.md)
  lost       the recovered end differs from the reference and nothing names why
  named      it differs, and a metric or a result names the fault (a rewarder error flagged host_fault)
  identical  the recovered end equals the reference (metrics step by step, evaluation results, verdicts)
  missed     the chosen process never appeared before the command ended: no fault sent (not a failure)
The command exits 1 if any trial is hang, leak, traceback, exit or lost.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import _util

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT))
from gapo.errors import Exit  # noqa: E402
from gapo.proc import processes, stat_fields  # noqa: E402

SIGNALS = ("SIGKILL", "SIGTERM", "SIGINT", "SIGSTOP")
FAILURES = ("hang", "leak", "traceback", "exit", "lost")
ROLES = {  # role -> how its command line reads (a substring of /proc/<pid>/cmdline, words joined by spaces)
    "launcher": "bin/gapo-train ", "torchrun": "-m gapo.launch", "rank": "-u -m gapo.cli",
    "math_worker": "_worker_main", "sweep": "bin/gapo-sweep ", "evaluation": "bin/gapo-eval ",
    "harness": "sandbox_harness.py", "program": None,  # (the harness's child: found by its parent)
}
NOT_COMPARED = ("time/", "throughput/", "memory/", "resume/", "branch/")  # how long, how much: not what was learnt
TOLERANCE = 1e-4  # relative: a resumed run continues exactly on CPU fp32, up to the engine's summation noise

# The code scenario's driver: 6 programs that each compute ~1 s, scored against their test by the real sandbox.
CODE_DRIVER = """import json, sys
from gapo.reward.code import CodeRunner
program = "```python\\nn = int(input())\\ns = 0\\nfor i in range(6_000_000):\\n    s += i % 7\\nprint(n * 2)\\n```"
tests = {"inputs": ["21\\n"], "outputs": ["42\\n"]}
with CodeRunner(num_workers=2, timeout_s=60.0) as runner:
    got = runner.score([program] * 6, tests)
json.dump([[r.status, list(r.flags)] for r in got], open(sys.argv[1], "w"))
"""

MANIFEST = """name: faults
title: the fault campaign's sweep
produces: one run and its evaluation
config: tiny_cpu
nproc: 1
seeds: [0]
runs:
  - name: gapo
    overrides: [trainer.total_steps=2, trainer.save_every=1, tracking.mode=disabled]
eval:
  protocol: {name: tiny, benchmarks: [arithmetic], n: 4, temperature: 1.0, max_new_tokens: 24, limit: 8}
  steps: [2]
  compile: eager
"""


@dataclass(frozen=True)
class Trial:
    scenario: str
    role: str
    signal: str
    at_s: float  # seconds after the command started

    def spec(self) -> str:
        return f"{self.scenario}:{self.role}:{self.signal}:{self.at_s:.1f}"

    @staticmethod
    def parse(text: str) -> Trial:
        scenario, role, sig, at = text.split(":")
        if scenario not in SCENARIOS or role not in SCENARIOS[scenario] or sig not in SIGNALS:
            raise SystemExit(f"--trial {text}: expected SCENARIO:ROLE:SIGNAL:SECONDS with a scenario of "
                             f"{', '.join(SCENARIOS)}, one of its roles and one of {', '.join(SIGNALS)}")
        return Trial(scenario, role, sig, float(at))


SCENARIOS = {"train1": ("launcher", "math_worker"), "train2": ("launcher", "torchrun", "rank", "math_worker"),
             "sweep": ("sweep", "launcher", "math_worker", "evaluation"), "code": ("harness", "program")}


# ------------------------------------------------------------------------------------------------ the commands


def commands(scenario: str, work: Path) -> list[list[str]]:
    """The commands a scenario runs one after another (the sweep: train, then evaluate)."""
    if scenario in ("train1", "train2"):
        return [[str(BIN / "gapo-train"), "--config", "tiny_cpu", "--nproc", scenario[-1],
                 f"trainer.output_dir={work / 'run'}", "trainer.save_every=1", "tracking.mode=disabled"]]
    if scenario == "sweep":
        (work / "faults.yaml").write_text(MANIFEST)
        sweep = [str(BIN / "gapo-sweep"), str(work / "faults.yaml")]
        return [[*sweep, "--run", "--output-root", str(work)], [*sweep, "--eval", "--output-root", str(work)]]
    (work / "driver.py").write_text(CODE_DRIVER)
    return [[sys.executable, str(work / "driver.py"), str(work / "verdicts.json")]]


def recovery(scenario: str, cmd: list[str]) -> list[str] | None:
    """The documented way on after `cmd` failed: None where there is none to take (a rewarder's verdict stands)."""
    if scenario.startswith("train"):
        return [*cmd, "--resume", "auto"]
    return cmd if scenario == "sweep" else None


def outcome(scenario: str, work: Path) -> dict:
    """What the run produced, to compare with the reference: training metrics by step, evaluation results, or the
    rewarder's verdicts."""
    if scenario == "code":
        path = work / "verdicts.json"
        return {"verdicts": json.loads(path.read_text()) if path.is_file() else None}
    run = work / "run" if scenario.startswith("train") else work / "faults" / "gapo" / "seed0"
    path = run / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []
    out = {"steps": {str(r["step"]): r for r in rows if "reward/mean" in r}}
    results = sorted(run.glob("eval/*/step_*/results.json"))
    out["eval"] = {str(p.relative_to(run)): json.loads(p.read_text())["metrics"] for p in results}
    return out


def compare(ref: dict, got: dict) -> list[str]:
    """Where `got` differs from `ref` (empty: identical)."""
    if "verdicts" in ref:
        return [] if got["verdicts"] == ref["verdicts"] else [f"verdicts {got['verdicts']} (reference "
                                                              f"{ref['verdicts']})"]
    diffs = [f"steps {sorted(got['steps'])} (reference {sorted(ref['steps'])})"] if (
        sorted(got["steps"]) != sorted(ref["steps"])) else []
    for step, row in ref["steps"].items():
        other = got["steps"].get(step, {})
        diffs += [f"step {step} {k}: {other[k]} (reference {v})" for k, v in row.items()
                  if k in other and not k.startswith(NOT_COMPARED) and not _close(v, other[k])]
    if got["eval"] != ref["eval"]:
        diffs += [f"evaluation {sorted(got['eval'])} differs from the reference's"]
    return diffs


def _close(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float | int):
        return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= TOLERANCE * max(1.0, abs(a))
    return a == b


def named(got: dict) -> bool:
    """The difference is accounted for: a rollout or verdict flagged as a host fault."""
    if "verdicts" in got:
        return any("host_fault" in flags for _, flags in got["verdicts"] or [])
    return any(r.get("reward/host_fault_frac", 0) > 0 for r in got["steps"].values())


# ------------------------------------------------------------------------------------------------ watching a run


@dataclass
class Watch:
    """The processes of a command, polled every 0.1 s while it runs: its descendants, and processes carrying the
    trial's tag that a dead parent left to init. Every one ever seen is remembered (pid and start time) for the leak
    check."""

    root: subprocess.Popen
    tag: str
    seen: dict[int, tuple[str, str]] = field(default_factory=dict)  # pid -> (start time, command line)
    now: dict[int, str] = field(default_factory=dict)  # the latest poll: pid -> command line
    parents: dict[int, int] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)
    lives: dict[str, tuple[float, float]] = field(default_factory=dict)  # role -> (first, last) seen, s from start
    start: float = field(default_factory=time.monotonic)

    def poll(self) -> None:
        table = {pid: f for pid, f in processes()}
        children: dict[int, list[int]] = {}
        for pid, f in table.items():
            children.setdefault(int(f[1]), []).append(pid)
        found, todo = set(), [self.root.pid]
        while todo:
            pid = todo.pop()
            found.add(pid)
            todo += children.get(pid, [])
        found |= {pid for pid in table if _tagged(pid, self.tag)}
        now = {}
        for pid in found:
            cmd = _cmdline(pid)
            if pid in table and cmd and table[pid][0] not in "ZX":
                now[pid] = cmd
                self.seen.setdefault(pid, (table[pid][19], cmd))
                self.parents[pid] = int(table[pid][1])
        self.now = now
        at = time.monotonic() - self.start
        for role in ROLES:
            if self.of_role(role):
                self.lives[role] = (self.lives.get(role, (at, at))[0], at)

    def run(self) -> None:
        while not self.done.is_set():
            self.poll()
            time.sleep(0.1)

    def of_role(self, role: str) -> list[int]:
        if role == "program":
            harnesses = set(self.of_role("harness"))
            return [p for p in self.now if self.parents.get(p) in harnesses]
        return [p for p, cmd in self.now.items() if ROLES[role] in cmd + " "]

    def alive(self) -> list[str]:
        """The remembered processes still alive (the same pid and start time, not a zombie)."""
        out = []
        for pid, (start, cmd) in self.seen.items():
            f = stat_fields(pid)
            if f is not None and f[19] == start and f[0] not in "ZX" and pid != self.root.pid:
                out.append(f"{pid} {cmd[:80]}")
        return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _tagged(pid: int, tag: str) -> bool:
    try:
        return f"GAPO_FAULT_TRIAL={tag}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


# ------------------------------------------------------------------------------------------------ one trial


@dataclass
class Ended:
    code: int | None  # None: it did not end in time (killed by the campaign)
    stderr: str
    seconds: float
    leaked: list[str]
    fault: str  # what was done, or "" when the role's process never appeared
    killed_root: bool = False  # the fault was SIGKILL to this command's own process: its exit is -9 by definition
    lives: dict[str, tuple[float, float]] = field(default_factory=dict)  # role -> (first, last) seen, s from start


def run_one(cmd: list[str], tag: str, limit_s: float, trial: Trial | None, rng: random.Random,
            offset: float = 0.0) -> Ended:
    """`cmd` to its end, watched; `trial`'s fault sent at its moment (`offset`: the scenario's seconds before `cmd`)."""
    env = {**os.environ, "GAPO_FAULT_TRIAL": tag, "OMP_WAIT_POLICY": "PASSIVE", "WANDB_SILENT": "true"}
    env.pop("GAPO_PARENT_PID", None)  # started as a person starts it
    start = time.monotonic()
    root = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    watch = Watch(root, tag, start=start)
    poller = threading.Thread(target=watch.run, daemon=True)
    poller.start()
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.append(root.stderr.read()), daemon=True)
    reader.start()
    fault, target = _inject(watch, trial, start - offset, rng) if trial else ("", None)
    try:
        code = root.wait(timeout=max(1.0, limit_s - (time.monotonic() - start)))
    except subprocess.TimeoutExpired:
        code = None
        for pid in list(watch.now):
            _signal(pid, signal.SIGKILL)
        root.wait()
    took = time.monotonic() - start
    time.sleep(2.0)
    watch.done.set()
    poller.join()
    reader.join(timeout=5)
    leaked = watch.alive()
    for line in leaked:  # leave the machine as it was
        _signal(int(line.split()[0]), signal.SIGKILL)
    return Ended(code, "".join(err), took, leaked, fault, target == root.pid and trial.signal == "SIGKILL",
                 watch.lives)


def _inject(watch: Watch, trial: Trial, start: float, rng: random.Random) -> tuple[str, int | None]:
    """At trial.at_s, or as soon after as the role's process exists, the signal to one of them (chosen by `rng`):
    what was done, and to which pid."""
    while time.monotonic() - start < trial.at_s and watch.root.poll() is None:  # (start: the scenario's)
        time.sleep(0.05)
    while watch.root.poll() is None:
        targets = sorted(watch.of_role(trial.role))
        if targets:
            pid = rng.choice(targets)
            sig = signal.Signals[trial.signal]
            _signal(pid, sig)
            if sig == signal.SIGSTOP:
                pause = rng.uniform(1.0, 5.0)
                time.sleep(pause)
                _signal(pid, signal.SIGCONT)
                return (f"{trial.signal} to {trial.role} {pid} at {time.monotonic() - start - pause:.1f} s, SIGCONT "
                        f"{pause:.1f} s later"), pid
            return f"{trial.signal} to {trial.role} {pid} at {time.monotonic() - start:.1f} s", pid
        time.sleep(0.05)
    return "", None


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:  # it ended meanwhile
        pass


def classify(trial: Trial, ended: list[Ended], fault: str, ref: dict, got: dict) -> tuple[str, str]:
    """The trial's class and the evidence for it."""
    if any(e.code is None for e in ended):
        return "hang", "no end within the limit"
    leaked = [x for e in ended for x in e.leaked]
    if leaked:
        return "leak", "; ".join(leaked[:3])
    users = trial.signal == "SIGINT" and trial.role in ("launcher", "sweep")  # a Ctrl-C: the user's own
    if not users and any("Traceback (most recent call last)" in e.stderr for e in ended):
        text = next(e.stderr for e in ended if "Traceback (most recent call last)" in e.stderr)
        return "traceback", text[text.index("Traceback"):][:200].replace("\n", " | ")
    listed = {int(c) for c in Exit}
    odd = [e.code for e in ended if e.code not in listed and not (e.killed_root and e.code == -signal.SIGKILL)]
    if odd:
        return "exit", f"exit {odd[0]}"
    if not fault:
        return "missed", "the process never appeared"
    diffs = compare(ref, got)
    if not diffs:
        return "identical", ""
    return ("named" if named(got) else "lost"), "; ".join(diffs[:2])[:200]


def trial_run(trial: Trial, refs: dict, base: Path, index: int, rng: random.Random) -> tuple[str, str, str, float]:
    """(class, evidence, what was done, seconds) of one trial in a fresh folder."""
    work = base / f"trial{index:02d}-{trial.scenario}"
    work.mkdir(parents=True)
    limit = 4 * refs[trial.scenario]["seconds"] + 60
    ended: list[Ended] = []
    cmds = commands(trial.scenario, work)
    took = 0.0
    for i, cmd in enumerate(cmds):  # the moment counts from the scenario's start, over its commands
        pending = None if any(e.fault for e in ended) else trial
        e = run_one(cmd, f"{base.name}-{index}-{i}", limit, pending, rng, offset=took)
        ended.append(e)
        took += e.seconds
        if e.code not in (0, None) and (again := recovery(trial.scenario, cmd)) is not None:
            r = run_one(again, f"{base.name}-{index}-{i}r", limit, None, rng)
            ended.append(r)
            took += r.seconds
        if ended[-1].code not in (0,):
            break
    fault = next((e.fault for e in ended if e.fault), "")
    kind, why = classify(trial, ended, fault, refs[trial.scenario]["outcome"], outcome(trial.scenario, work))
    return kind, why, fault, took


def reference(scenario: str, base: Path) -> dict:
    work = base / f"reference-{scenario}"
    work.mkdir(parents=True)
    took, lives = 0.0, {}
    for i, cmd in enumerate(commands(scenario, work)):
        e = run_one(cmd, f"{base.name}-ref-{scenario}-{i}", 1800, None, random.Random(0))
        if e.code != 0 or e.leaked:
            raise SystemExit(f"the uninterrupted {scenario} run failed (exit {e.code}; left {e.leaked}): "
                             f"{shlex.join(cmd)}\n{e.stderr[-2000:]}")
        lives.update({role: (a + took, b + took) for role, (a, b) in e.lives.items() if role not in lives})
        took += e.seconds
    return {"outcome": outcome(scenario, work), "seconds": took, "lives": lives}


def draw(rng: random.Random, refs: dict[str, dict]) -> Trial:
    """A scenario, a role, a signal, and a moment while the reference run had that role's process (so that few
    trials miss; a process that lives 0.1 s may still be missed)."""
    scenario = rng.choice(sorted(refs))
    role = rng.choice(SCENARIOS[scenario])
    first, last = refs[scenario]["lives"].get(role, (0.0, 0.9 * refs[scenario]["seconds"]))
    return Trial(scenario, role, rng.choice(SIGNALS), round(rng.uniform(first, first + 0.9 * (last - first)), 1))


def slurm_answers() -> bool:
    return shutil.which("sinfo") is not None and subprocess.run(["sinfo"], capture_output=True).returncode == 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trials", type=int, default=30)
    p.add_argument("--trial", action="append", type=Trial.parse, help="SCENARIO:ROLE:SIGNAL:SECONDS (repeatable); "
                   "instead of drawing --trials")
    p.add_argument("--keep", action="store_true", help="keep the trials' folders (printed)")
    args = p.parse_args()
    print(_util.cpu_line(), flush=True)
    base = Path(tempfile.mkdtemp(prefix="gapo-faults-"))
    rng = random.Random(args.seed)
    wanted = sorted({t.scenario for t in args.trial} if args.trial else SCENARIOS)
    refs = {}
    for s in wanted:
        refs[s] = reference(s, base)
        print(f"reference {s}: {refs[s]['seconds']:.0f} s", flush=True)
    print("slurm: SKIP (no SLURM controller answers `sinfo`)" if not slurm_answers() else
          "slurm: SKIP (its chain is tests/test_cluster.py's; not drawn here)", flush=True)
    trials = args.trial or [draw(rng, refs) for _ in range(args.trials)]
    rows, counts = [], {}
    for i, t in enumerate(trials, 1):
        kind, why, fault, took = trial_run(t, refs, base, i, rng)
        counts[kind] = counts.get(kind, 0) + 1
        again = "" if kind in ("identical", "named", "missed") else \
            f"  reproduce: .venv/bin/python bench/faults.py --seed {args.seed} --trial {t.spec()}"
        said = f"  ({why})" if why else ""
        rows.append(f"{i:3d} {t.spec():38s} {kind:9s} {took:5.0f} s  {fault or '-'}{said}{again}")
        print(rows[-1], flush=True)
    print("\n" + ", ".join(f"{k} {counts[k]}" for k in sorted(counts)) + f" of {len(trials)} trials (seed {args.seed})")
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    else:
        print(f"trials' folders: {base}")
    return 1 if any(k in counts for k in FAILURES) else 0


if __name__ == "__main__":
    sys.exit(main())
