"""Where two clip rules can decide differently: an experiment's band count, before paying for its seeds.

Two sequence-level rules (GSPO, GAPO) clip a correct rollout's update when its ratio s exceeds 1 + eps_hi(c), an
incorrect one's when s < 1 - eps_lo. They decide differently exactly when s lies between their two bounds: for
GAPO against asymmetric GSPO at the same eps_hi_max that is the band (1 + eps_hi(c), 1 + eps_hi_max], empty at
c = 1 and widest at c = k - 1. Only decisions in the band can make two runs differ; a design with a handful of
them cannot tell the rules apart whatever its seed count. The counts here are read off the ratios a run logged
(rollouts.jsonl, trainer.log_rollouts) and judged under both rules: a counterfactual on that run's trajectory,
exact up to the first decision that differs.

A decision is one off-policy update of one rollout (the step's first optimizer step is on-policy: its ratios
are 1 and nothing clips). Rollouts logged before updates carried `off_policy` are told apart by |s - 1| < 1e-4
(on-policy ratios are 1 to float32 rounding), which the output says.

Two arms run on the same seed make the same decisions until the first one the rules judge differently: both logs
hold that shared prefix, and counting both would count each of its decisions twice. count() takes such a pair
as one unit: the first run's decisions, and the second run's from where the two logs first differ (shared_prefix).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gapo import rundir
from gapo.algorithms import PRESETS
from gapo.clip import RULES, fmt_eps
from gapo.config import AlgorithmConfig
from gapo.configfile import load_plugins, read_yaml, resolve
from gapo.errors import ConfigError, Exit
from gapo.study.figures import PlotError, algorithm_of, md_cell

LEGACY_ON_POLICY = 1e-4  # |s - 1| below this counts as on-policy in logs without the off_policy flag


@dataclass(frozen=True)
class Rule:
    """A sequence-level clip rule as the band count needs it: a label and its bounds."""

    label: str
    algo: AlgorithmConfig

    def upper(self, c: int, k: int) -> float:
        return float(self.algo.rule.eps_hi(min(max(c, 1), k), k, self.algo))  # c = 0 has no correct rollout

    def clips(self, ratio: float, adv: float, c: int, k: int) -> bool:
        if adv > 0:
            return ratio > 1 + self.upper(c, k)
        return adv < 0 and ratio < 1 - self.algo.eps_lo


def rule(spec: str) -> Rule:
    """NAME:EPS_LO[/EPS_HI]: a preset with its widths (the upper one is eps_hi_max of an adaptive rule, eps_hi of
    a fixed one; without it a fixed rule is symmetric). gapo:0.003/0.015, gspo:0.003/0.015, gspo:0.003. NAME may
    also be a clip rule (gapo.clip.RULES, a plugin's included): sequence IS under that rule."""
    name, sep, widths = spec.partition(":")
    lo, _, hi = widths.partition("/")
    try:
        eps_lo = float(lo)
        eps_hi = float(hi) if hi else None
    except ValueError:
        eps_lo = eps_hi = None
    if not sep or eps_lo is None:
        raise ConfigError(f"rule {spec!r}: expected NAME:EPS_LO[/EPS_HI], e.g. gapo:0.003/0.015 or gspo:0.003")
    raw: dict = {"name": name.strip(), "eps_lo": eps_lo}
    if raw["name"] not in PRESETS and raw["name"] in RULES:  # a clip rule: the sequence-IS preset of its shape
        kind = RULES[raw["name"]]
        raw = {"name": next(n for n, p in PRESETS.items() if p["is_level"] == "sequence" and
                            RULES[p["clip"]].upper_field == kind.upper_field), "clip": kind.name, "eps_lo": eps_lo}
    try:
        probe = resolve({"algorithm": {"name": raw["name"]}}).algorithm
    except ConfigError as e:
        raise ConfigError(f"rule {spec!r}: {e}") from None
    raw[probe.rule.upper_field] = eps_hi if eps_hi is not None else eps_lo
    algo = resolve({"algorithm": raw}).algorithm
    return checked(Rule(spec, algo))


def run_rule(run_dir: Path, label: str, cfg: dict) -> Rule:
    algo = algorithm_of(cfg)
    if algo is None:
        raise PlotError(f"{run_dir}: its {rundir.CONFIG} holds no algorithm that resolves")
    return checked(Rule(label, algo))


def checked(r: Rule) -> Rule:
    if r.algo.is_level != "sequence" or r.algo.bounds_the_weight:
        raise ConfigError(f"rule {r.label!r} ({r.algo.name}): band counts need a sequence-level PPO clip rule "
                          "(GSPO, GAPO and their asymmetric forms); a token-level rule decides per token, and "
                          "rollouts.jsonl logs sequence ratios")
    return r


def describe(r: Rule, k: int = 8) -> str:
    a = r.algo
    hi = (f"1 + {fmt_eps(r.upper(1, k))}" if a.rule.constant else
          f"1 + eps_hi(c): {fmt_eps(r.upper(1, k))} at c = 1 .. {fmt_eps(r.upper(k - 1, k))} at c = {k - 1}")
    return f"{r.label}: 1 - {fmt_eps(a.eps_lo)} .. {hi}"


@dataclass
class BandCount:
    """One c's decisions over some runs: how many, and how many the two rules decide differently."""

    decisions: int = 0
    differ: int = 0
    only_first: int = 0  # clipped by the first rule only
    only_second: int = 0

    def add(self, a: bool, b: bool) -> None:
        self.decisions += 1
        if a != b:
            self.differ += 1
            self.only_first += a
            self.only_second += b


@dataclass
class Bands:
    """Per c, correct rollouts' decisions (the upper bound acts); incorrect rollouts' decisions pooled over c (the
    lower bound acts); over the runs read."""

    correct: dict[int, BandCount]
    incorrect: BandCount
    runs: int
    legacy: bool  # some log had no off_policy flag: on-policy updates told apart by |s - 1|
    k: int  # the largest group size seen
    pairs: int = 0  # same-seed pairs among the runs, each counted once up to where its two runs diverge
    shared: int = 0  # decisions of the pairs' second runs left out as the same as their first runs'

    @property
    def all_correct(self) -> BandCount:
        """The correct rollouts' decisions over every c. Incorrect ones stay out: two rules with the same eps_lo
        cannot decide them differently, so adding them would only dilute the share in the band."""
        t = BandCount()
        for b in self.correct.values():
            t.decisions += b.decisions
            t.differ += b.differ
            t.only_first += b.only_first
            t.only_second += b.only_second
        return t


def rollouts_log(run_dir: Path) -> Path:
    path = Path(run_dir) / rundir.ROLLOUTS
    if not path.is_file():
        raise PlotError(f"{run_dir}: no {rundir.ROLLOUTS} (set trainer.log_rollouts=true to log every rollout's "
                        "ratios; band counts are read from it)")
    return path


ROLLOUT_KEYS = ("adv", "updates")  # what the band counts and the endpoints take from every rollout record


def read_rollouts(run_dir: Path) -> list[dict]:
    path = rollouts_log(run_dir)
    lines = path.read_text(encoding="utf-8").splitlines()
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if n == len(lines):  # a live run's last line, still being written
                break
            raise PlotError(f"{path}:{n}: not a JSON record ({e.msg})") from None
        missing = [k for k in ROLLOUT_KEYS if not isinstance(rec, dict) or k not in rec]
        if missing:
            raise PlotError(f"{path}:{n}: not a rollout record of gapo-train's (no {', '.join(missing)})")
        out.append(rec)
    return out


def _rollout_key(rec: dict) -> tuple:
    """What makes two logged rollouts the same rollout: its step, rank, problem, text and advantage (not eps_hi,
    which is the rule's and differs between arms on the same trajectory)."""
    return tuple(rec.get(f) for f in ("step", "rank", "problem", "text", "c", "k", "adv"))


def shared_prefix(a: list[dict], b: list[dict]) -> int:
    """How many updates, in log order, two runs' records share before their trajectories part: the same step and
    rollout, the same update index and the same ratio to float equality. From the first mismatch on, the runs are
    different trajectories and each update of either is a decision of its own."""
    n = 0
    for ra, rb in zip(a, b, strict=False):  # the shorter log ends the prefix
        if _rollout_key(ra) != _rollout_key(rb):
            return n
        ua, ub = ra["updates"], rb["updates"]
        for x, y in zip(ua, ub, strict=False):
            if float(x["is_ratio"]) != float(y["is_ratio"]):
                return n
            n += 1
        if len(ua) != len(ub):
            return n
    return n


def count(run_dirs: list[Path], first: Rule, second: Rule,
          pairs: Sequence[tuple[Path, Path]] = ()) -> Bands:
    """Judge every off-policy decision logged in `run_dirs` under both rules. Each of `pairs` (two arms' runs of
    the same seed) counts its first run's decisions and its second run's from where the two logs first differ."""
    correct: dict[int, BandCount] = {}
    incorrect = BandCount()
    legacy, kmax, shared = False, 0, 0

    def judge(records: list[dict], skip: int = 0) -> int:
        """Add the records' decisions after their first `skip` updates; return the decisions skipped."""
        nonlocal legacy, kmax
        n = skipped = 0
        for rec in records:
            adv, c, k = float(rec["adv"]), int(rec["c"]), int(rec["k"])
            kmax = max(kmax, k)
            for u in rec["updates"]:
                n += 1
                s = float(u["is_ratio"])
                if adv == 0:
                    continue  # no advantage, no gradient: neither bound acts
                if "off_policy" in u:
                    if not u["off_policy"]:
                        continue
                else:
                    legacy = True
                    if abs(s - 1) < LEGACY_ON_POLICY:
                        continue
                if n <= skip:
                    skipped += 1
                    continue
                cell = correct.setdefault(c, BandCount()) if adv > 0 else incorrect
                cell.add(first.clips(s, adv, c, k), second.clips(s, adv, c, k))
        return skipped

    for d in run_dirs:
        judge(read_rollouts(d))
    for da, db in pairs:
        ra, rb = read_rollouts(da), read_rollouts(db)
        judge(ra)
        shared += judge(rb, shared_prefix(ra, rb))
    return Bands(dict(sorted(correct.items())), incorrect, len(run_dirs) + 2 * len(pairs), legacy, kmax or 8,
                 len(pairs), shared)


def table(bands: Bands, first: Rule, second: Rule) -> list[str]:
    """Markdown: per c, decisions and those in the band (where the rules differ), with who clips."""
    pairs = (f"; {bands.pairs} same-seed pair(s) counted once up to where their runs diverge, "
             f"{bands.shared} shared decision(s) not counted twice" if bands.pairs else "")
    out = [f"Decisions (off-policy updates of rollouts with A ≠ 0, {bands.runs} run(s){pairs}) where "
           f"{md_cell(first.label)} and {md_cell(second.label)} decide differently:", "",
           "| c | decisions | in the band | clipped by the first only | by the second only | share in the band |",
           "|---|---|---|---|---|---|"]
    rows = [(f"{c} (correct)", b) for c, b in bands.correct.items()]
    rows += [("all correct (upper bound)", bands.all_correct), ("incorrect (lower bound)", bands.incorrect)]
    for name, b in rows:
        share = f"{b.differ / b.decisions:.1%}" if b.decisions else "–"
        out.append(f"| {name} | {b.decisions} | {b.differ} | {b.only_first} | {b.only_second} | {share} |")
    if bands.legacy:
        out += ["", f"Some logs carry no off_policy flag (written before it existed): updates with |s − 1| < "
                f"{LEGACY_ON_POLICY:g} were taken as on-policy."]
    return out


def main(args) -> int:
    """`gapo-compare band RUN [RUN ...] --rules A B`: the band count of two rules on logged runs."""
    import sys
    try:
        dirs = [Path(d) for d in args.runs]
        for d in dirs:
            if not d.is_dir():
                raise PlotError(f"run directory {str(d)!r} does not exist")
            saved = d / rundir.CONFIG
            if saved.is_file():  # the runs' plugins first: a rule may be one of theirs
                load_plugins((read_yaml(saved.read_text()) or {}).get("plugins") or [])
        first, second = (rule(s) for s in args.rules)
        bands = count(dirs, first, second)
    except (ConfigError, PlotError) as e:
        print(f"gapo-compare: error: {e}", file=sys.stderr)
        return Exit.CONFIG
    print("\n".join([describe(first, bands.k), describe(second, bands.k), "", *table(bands, first, second)]))
    return 0
