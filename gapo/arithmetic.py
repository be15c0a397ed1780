"""The embedded arithmetic set: a spread of difficulty so that groups span c = 0..k for a small model. Its own
module, importing nothing of gapo's, because the config checks a size against its levels (gapo.config) and the
loaders turn it into problems (gapo.data)."""

from __future__ import annotations

import random

LEVELS = (
    ("add_small", lambda r: (r.randint(1, 20), "+", r.randint(1, 20))),
    ("add_2digit", lambda r: (r.randint(10, 99), "+", r.randint(10, 99))),
    ("sub_2digit", lambda r: (r.randint(10, 99), "-", r.randint(1, 99))),
    ("add_3digit", lambda r: (r.randint(100, 999), "+", r.randint(10, 999))),
    ("mul_small", lambda r: (r.randint(2, 12), "*", r.randint(2, 12))),
    ("mul_2digit", lambda r: (r.randint(2, 9), "*", r.randint(11, 99))),
)


def draw(n: int, seed: int, exclude: set[str] | None = None,
         levels: list[str] | None = None) -> list[tuple[str, str, str]]:
    """n distinct (question, answer, level), levels taken in turn, deterministic in `seed`; questions in
    `exclude` are skipped."""
    known = [name for name, _ in LEVELS]
    if levels is not None and (not levels or set(levels) - set(known)):
        raise ValueError(f"data.arithmetic_levels={levels}: choose from {known}")
    pool = [lv for lv in LEVELS if levels is None or lv[0] in levels]
    rng = random.Random(seed)
    seen = set(exclude or ())
    out: list[tuple[str, str, str]] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ValueError(f"cannot draw {n} distinct arithmetic problems (only {len(out)} found)")
        level, make = pool[attempts % len(pool)]  # round-robin; a small level that runs dry is skipped
        a, op, b = make(rng)
        question = f"What is {a} {op} {b}?"
        if question in seen:
            continue
        seen.add(question)
        out.append((question, str(a + b if op == "+" else a - b if op == "-" else a * b), level))
    return out
