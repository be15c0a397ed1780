"""Evaluation math: the unbiased pass@k estimator and problem coverage."""

from __future__ import annotations

from collections.abc import Iterable


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021).

    Computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i): no huge binomials, so it is exact enough for n = 256
    and beyond (the ratio of binomials would overflow floats long before).
    """
    if not (isinstance(n, int) and isinstance(c, int) and isinstance(k, int)):
        raise TypeError(f"pass_at_k expects integers, got n={n!r}, c={c!r}, k={k!r}")
    if n < 1 or not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs n >= 1, 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def coverage(solve_rates: Iterable[float], threshold: float = 0.05) -> int:
    """Problems solved more often than `threshold` (the paper's Fig. 8 counts solve rate > 5 %)."""
    return sum(1 for r in solve_rates if r > threshold)
