"""gapo-plot's rollout pages: per run that logged rollouts.jsonl, an HTML page of sampled rollouts per c at a few
steps, with their text, advantage, IS ratio per update, bound and clip decision: the rollouts behind the figures.
"""

from __future__ import annotations

import html
import json
import random
import re
import sys
from collections.abc import Iterable
from pathlib import Path

from gapo import rundir
from gapo.study.figures import PlotError, Run, algorithm_of, run_algorithm


def iter_rollouts(path: Path) -> Iterable[dict]:
    """rollouts.jsonl's records one at a time (the file holds every rollout of the run and can be large)."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                    raise ValueError("expected a JSON object with an integer 'step'")
            except ValueError as e:
                if not line.endswith("\n"):
                    print(f"gapo-plot: warning: {path}:{lineno}: incomplete last line skipped (run still writing?)",
                          file=sys.stderr)
                    return
                raise PlotError(f"{path}:{lineno}: malformed rollout record: {e}") from None
            yield rec


def pick_steps(available: list[int], requested: list[int] | None, where: Path) -> list[int]:
    """The requested steps that the run logged rollouts for, else its first, middle and last."""
    if not available:
        return []
    if requested is None:
        return sorted({available[0], available[len(available) // 2], available[-1]})
    missing = [st for st in requested if st not in set(available)]
    if missing:
        print(f"gapo-plot: warning: {where} has no rollouts at step(s) {', '.join(map(str, missing))} "
              f"(it has {len(available)} steps, {available[0]}–{available[-1]})", file=sys.stderr)
    return [st for st in requested if st in set(available)]


def _clipped(rec: dict) -> bool:
    return any(u.get("clip_hi_tokens") or u.get("clip_lo_tokens") for u in rec.get("updates", []))


def sample_bucket(recs: list[dict], n: int, seed: int) -> list[dict]:
    """Up to n rollouts of one c, half of them (rounded up) clipped ones when there are: what a reader wants to
    see is what was clipped, next to what was not. Repeatable (seeded), in the file's order."""
    rng = random.Random(seed)
    clipped = [i for i, r in enumerate(recs) if _clipped(r)]
    kept = [i for i, r in enumerate(recs) if not _clipped(r)]
    rng.shuffle(clipped)
    rng.shuffle(kept)
    half = (n + 1) // 2
    take = (clipped[:half] + kept + clipped[half:])[:n]
    return [recs[i] for i in sorted(take)]


def _esc(x) -> str:
    return html.escape(str(x), quote=True)


def _update_item(u: dict, adv: float, eps_hi: float, eps_lo, weight_clip: bool, token_level: bool, length: int) -> str:
    """One update of one rollout: its sequence IS ratio, the bound that applies to it and what the loss did."""
    lo = f"1−ε_lo = {1 - eps_lo:.6g}" if isinstance(eps_lo, int | float) else "1−ε_lo"
    hi = f"1+ε_hi = {1 + eps_hi:.6g}"
    bound = f"[{lo}, {hi}]" if weight_clip else hi if adv > 0 else lo if adv < 0 else "none (A = 0: no gradient)"
    verdicts = []
    for key, side in (("clip_hi_tokens", "high"), ("clip_lo_tokens", "low")):
        n = int(u.get(key) or 0)
        if n:
            verdicts.append(f"clipped {side}" + (f" ({n}/{length} tokens)" if token_level else ""))
    verdict = ", ".join(verdicts) or "kept"
    return (f"<li>ratio {float(u.get('is_ratio', float('nan'))):.6f} · bound {_esc(bound)} → "
            f"<b class=\"{'clip' if verdicts else 'kept'}\">{_esc(verdict)}</b></li>")


_PAGE_STYLE = """body{font-family:sans-serif;margin:1.5em;max-width:1400px}
table{border-collapse:collapse;width:100%;margin-bottom:1.2em}
th,td{border:1px solid #ccc;padding:4px 6px;vertical-align:top;font-size:13px;text-align:left}
th{background:#f0f0f0}tr.clipped{background:#fff3e6}
td ul{margin:0;padding-left:1.1em}b.clip{color:#b34700}b.kept{color:#2a7a2a}
pre{white-space:pre-wrap;max-height:24em;overflow:auto;margin:0;font-size:12px}
summary{cursor:pointer;color:#333}"""


def rollouts_page(run: Run, steps: list[int] | None = None, shown_per_c: int = 3) -> str | None:
    """A self-contained HTML page: for a few steps, sampled rollouts per c with their text, reward, advantage,
    bound eps_hi and, per update, the IS ratio and clip decision. None when the run logged no rollouts.jsonl
    (`trainer.log_rollouts=true`)."""
    path = run.path / rundir.ROLLOUTS
    if not path.is_file():
        return None
    available = sorted({rec["step"] for rec in iter_rollouts(path)})
    chosen = pick_steps(available, steps, path)
    by_step: dict[int, list[dict]] = {st: [] for st in chosen}
    for rec in iter_rollouts(path):
        if rec["step"] in by_step:
            by_step[rec["step"]].append(rec)
    a = run_algorithm(run.config)
    eps_lo, resolved = a.get("eps_lo"), algorithm_of(run.config)
    weight_clip = resolved is not None and resolved.bounds_the_weight
    token_level = a.get("is_level") != "sequence"
    title = f"Rollouts of {run.label}"
    parts = [f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{_esc(title)}</title>"
             f"<style>{_PAGE_STYLE}</style></head><body>", f"<h1>{_esc(title)}</h1>",
             f"<p>{_esc(run.path)} · algorithm {_esc(run.algorithm)} · clip {_esc(run.clip_range or '?')} "
             f"· IS level {_esc(a.get('is_level') or '?')}</p>",
             "<p>Per update of a rollout (in update order): its sequence IS ratio exp(mean log π/π_old), the bound "
             "that applies to its sign of A (1+ε_hi(c) above for A &gt; 0, 1−ε_lo below for A &lt; 0) and what "
             "the loss did. " + ("Under token IS the decision is per token: the counts say how many of the "
                                 "response's tokens were clipped. " if token_level else "") +
             "Rollouts of the step's first mini-batch have their first update at the sampling weights (ratio 1). "
             f"Per c, up to {shown_per_c} rollouts are sampled, half of them clipped ones where there are; "
             "clipped rows are shaded.</p>"]
    if not chosen:
        parts.append("<p>No rollouts at the requested steps.</p>")
    parts.append("<p>Steps: " + " · ".join(f"<a href=\"#step-{st}\">{st}</a>" for st in chosen) + "</p>")
    for st in chosen:
        recs = by_step[st]
        n_clip = sum(_clipped(r) for r in recs)
        parts.append(f"<h2 id=\"step-{st}\">Step {st}</h2><p>{len(recs)} rollouts, {n_clip} clipped in some "
                     "update</p>")
        buckets: dict[int, list[dict]] = {}
        for r in recs:
            buckets.setdefault(int(r.get("c", -1)), []).append(r)
        for c in sorted(buckets):
            group = buckets[c]
            k = group[0].get("k", "?")
            shown = sample_bucket(group, shown_per_c, seed=st * 1000 + c)
            parts.append(f"<h3>c = {c} of k = {_esc(k)} · ε_hi = {float(group[0].get('eps_hi', float('nan'))):.6g} · "
                         f"{len(group)} rollouts, {sum(_clipped(r) for r in group)} clipped · showing "
                         f"{len(shown)}</h3>")
            parts.append("<table><tr><th>rank</th><th>problem</th><th>reward</th><th>status</th><th>A</th>"
                         "<th>updates: IS ratio · bound → decision</th><th>tokens</th><th>response</th></tr>")
            for r in shown:
                adv, length = float(r.get("adv", 0.0)), int(r.get("len", 0))
                items = "".join(_update_item(u, adv, float(r.get("eps_hi", float("nan"))), eps_lo, weight_clip,
                                             token_level, length) for u in r.get("updates", []))
                text = str(r.get("text", ""))
                head = text[:100].replace("\n", " ") + ("…" if len(text) > 100 else "")
                trunc = " (truncated)" if r.get("truncated") else ""
                parts.append(f"<tr class=\"{'clipped' if _clipped(r) else 'kept'}\"><td>{_esc(r.get('rank', ''))}</td>"
                             f"<td>{_esc(r.get('problem', ''))}</td><td>{_esc(r.get('reward', ''))}</td>"
                             f"<td>{_esc(r.get('status', ''))}</td><td>{adv:+.4f}</td><td><ul>{items}</ul></td>"
                             f"<td>{length}{trunc}</td><td><details><summary>{_esc(head)}</summary>"
                             f"<pre>{_esc(text)}</pre></details></td></tr>")
            parts.append("</table>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def write_rollout_pages(runs: list[Run], out: Path, steps: list[int] | None = None,
                        shown_per_c: int = 3) -> dict[str, str]:
    """Label -> file name of the run's rollouts page, for the runs that logged rollouts."""
    pages: dict[str, str] = {}
    for r in runs:
        page = rollouts_page(r, steps, shown_per_c)
        if page is None:
            continue
        slug = re.sub(r"[^A-Za-z0-9._-]+", "_", r.label).strip("_") or "run"
        name = f"rollouts_{slug}.html"
        while name in pages.values():
            name = name.removesuffix(".html") + "_.html"
        (out / name).write_text(page, encoding="utf-8")
        pages[r.label] = name
    return pages
