"""The statistics of the seed comparisons: intervals and tests that take numbers, not runs (gapo-compare seeds'
tables and the laptop experiment's endpoints both use them). Each is checked against an independent computation in
tests/test_compare.py."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable

import numpy as np
from scipy import special, stats

LEVEL = 0.95


def expit(x: float) -> float:
    return float(1 / (1 + math.exp(-x)))


# logit of the intraclass correlation rho the profile maximizes over: from seeds that differ binomially (1.5e-8, a
# design effect of 1.15 at 10^7 decisions per seed) to seeds that clip all or nothing (1 - 6e-6). a + b = 1/rho - 1.
_RHO_LOGIT = np.linspace(-18.0, 12.0, 41)


def _bb_loglik(e: np.ndarray, u: np.ndarray, z: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Beta-binomial log-likelihood (less its binomial coefficients) at mean rate expit(z) (rows) and logit(rho) t
    (columns, one row of them per z or shared)."""
    mu = special.expit(z)[:, None]
    s = np.exp(-t) if t.ndim == 2 else np.exp(-t)[None, :]
    a, b = mu * s, (1 - mu) * s
    return (special.betaln(e[:, None, None] + a, (u - e)[:, None, None] + b) - special.betaln(a, b)).sum(0)


def _vertex(y0: np.ndarray, y1: np.ndarray, y2: np.ndarray) -> np.ndarray:
    """The top of the parabola through three equally spaced values whose middle one is the largest (y1 where the
    three are not concave)."""
    curv = 2 * y1 - y0 - y2
    return np.where(curv > 0, y1 + (y2 - y0) ** 2 / (8 * np.where(curv > 0, curv, 1.0)), y1)


def _bb_profile(e: np.ndarray, u: np.ndarray, z: np.ndarray) -> np.ndarray:
    """The beta-binomial log-likelihood at mean rate expit(z), maximized over rho: on the coarse grid, then on a
    fine one around each row's best point, then at the vertex of the parabola through the fine grid's best point
    and its neighbours (the coarse grid alone moved the bounds by up to 0.7 %)."""
    ll = _bb_loglik(e, u, z, _RHO_LOGIT)
    step = _RHO_LOGIT[1] - _RHO_LOGIT[0]
    t = _RHO_LOGIT[ll.argmax(1)][:, None] + np.linspace(-step, step, 13)[None, :]
    fine = _bb_loglik(e, u, z, t)
    best = fine.argmax(1)
    j, rows = np.clip(best, 1, t.shape[1] - 2), np.arange(len(z))
    top = np.where(best == j, _vertex(fine[rows, j - 1], fine[rows, j], fine[rows, j + 1]), fine[rows, best])
    return np.maximum(top, ll.max(1))


def beta_binomial_interval(counts: Iterable[tuple[float, float]], level: float = LEVEL) -> tuple[float, float]:
    """The profile-likelihood interval of the mean rate of a beta-binomial over seeds, (events, units) per seed:
    the rates whose profile deviance is within the chi-square (1 df) quantile. The rate is scanned on the logit
    scale over (1e-7, 1 - 1e-7), zooming in until the accepted stretch spans ten grid steps (with many decisions
    it is far narrower than the first grid's step), then each end is found on a fine grid of its own; 0 and 1
    close it where no seed had an event or a non-event."""
    e, u = (np.array(x, dtype=float) for x in zip(*counts, strict=True))
    e, u = e[u > 0], u[u > 0]
    if not len(u):
        return float("nan"), float("nan")
    q = float(stats.chi2.ppf(level, 1))
    z = np.linspace(-16.0, 16.0, 41)
    for _ in range(12):
        pl = _bb_profile(e, u, z)
        m = int(pl.argmax())
        top = float(_vertex(pl[m - 1], pl[m], pl[m + 1])) if 0 < m < len(z) - 1 else float(pl[m])
        inside = np.flatnonzero(2 * (top - pl) <= q)
        i, j = (int(inside[0]), int(inside[-1])) if len(inside) else (m, m)
        if j - i >= 10:
            break
        z = np.linspace(z[max(i - 1, 0)], z[min(j + 1, len(z) - 1)], 41)

    def end(a: float, b: float) -> float:
        """Where the deviance crosses the quantile between a (outside) and b (inside)."""
        zz = np.linspace(a, b, 21)
        dev = 2 * (top - _bb_profile(e, u, zz)) - q
        k = int(np.argmax(dev <= 0))
        return float(np.interp(0.0, [dev[k], dev[k - 1]], [zz[k], zz[k - 1]])) if k else a

    lo = 0.0 if e.sum() == 0 else expit(end(z[i - 1], z[i]) if i else z[0])
    hi = 1.0 if e.sum() == u.sum() else expit(end(z[j + 1], z[j]) if j < len(z) - 1 else z[-1])
    return lo, hi


def clopper_pearson(events: float, units: float, level: float = LEVEL) -> tuple[float, float]:
    """The exact binomial interval of events / units (0 of n gives [0, 1 - (alpha/2)^(1/n)], never zero width)."""
    a = 1 - level
    lo = 0.0 if events <= 0 else float(stats.beta.ppf(a / 2, events, units - events + 1))
    hi = 1.0 if events >= units else float(stats.beta.ppf(1 - a / 2, events + 1, units - events))
    return lo, hi


def ci_half_width(values: Iterable[float], level: float = LEVEL) -> float:
    v = np.asarray(list(values), dtype=float)
    if len(v) < 2:
        return float("nan")
    return float(stats.t.ppf((1 + level) / 2, len(v) - 1) * v.std(ddof=1) / math.sqrt(len(v)))


def welch(a: Iterable[float], b: Iterable[float]) -> tuple[float, float, float]:
    """Welch's t statistic, its Welch-Satterthwaite degrees of freedom and the two-sided p-value: the test for
    values that carry no trainer.seed (estimates built by hand), where nothing says which values belong together.
    Values with seeds are paired instead (paired_t). NaN when a side has fewer than two values or neither side has
    any spread (the test is undefined there: significance() says which)."""
    a, b = np.asarray(list(a), dtype=float), np.asarray(list(b), dtype=float)
    if len(a) < 2 or len(b) < 2 or (np.ptp(a) == 0 and np.ptp(b) == 0):
        return float("nan"), float("nan"), float("nan")
    with warnings.catch_warnings():  # one side without spread is a valid case; scipy warns of "nearly identical" data
        warnings.simplefilter("ignore", RuntimeWarning)
        res = stats.ttest_ind(a, b, equal_var=False)
    return float(res.statistic), float(res.df), float(res.pvalue)


def significance(a: Iterable[float], b: Iterable[float]) -> str:
    """Welch's p-value as a table shows it, with the cases where the test is undefined said in words. Only
    difference_cell's fallback for values without seeds uses it: unpaired because nothing pairs those values,
    not because pairing would be wrong where seeds exist."""
    a, b = list(a), list(b)
    if len(a) < 2 or len(b) < 2:
        return "(n < 2: no test)"
    if np.ptp(a) == 0 and np.ptp(b) == 0:
        return "(no spread on either side: identical)" if a[0] == b[0] else \
            "(no spread on either side: every seed differs the same way; no test)"
    _, _, p = welch(a, b)
    return f"{stars(p)} (p = {p:.2g})"


def paired_t(d: Iterable[float], level: float = LEVEL) -> tuple[float, float, float, float]:
    """Mean of the per-seed differences, its Student-t interval (df = pairs - 1) and the two-sided p-value of the
    paired t-test; NaN interval and p below two pairs or without spread."""
    d = np.asarray(list(d), dtype=float)
    m = float(d.mean()) if len(d) else float("nan")
    if len(d) < 2 or np.ptp(d) == 0:
        return m, float("nan"), float("nan"), float("nan")
    h = ci_half_width(d, level)
    p = float(stats.ttest_1samp(d, 0.0).pvalue)
    return m, m - h, m + h, p


def sign_flip_p(d: Iterable[float]) -> float:
    """Exact two-sided p of the sign-flip (permutation) test of mean(d) = 0: every assignment of signs counted.
    It assumes only that each difference is symmetric about 0 under no effect; with n pairs its smallest p is
    2 / 2^n (0.0625 at 5 pairs), whatever the data."""
    d = np.asarray(list(d), dtype=float)
    n = len(d)
    if n == 0 or n > 20:
        return float("nan")
    signs = 1 - 2 * ((np.arange(2**n)[:, None] >> np.arange(n)) & 1)
    means = np.abs((signs * d).mean(axis=1))
    return float(np.mean(means >= abs(d.mean()) - 1e-12))


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values (family-wise error), in the input order; NaN stays NaN, uncounted."""
    idx = [i for i, p in enumerate(pvalues) if math.isfinite(p)]
    m, out, running = len(idx), [float("nan")] * len(pvalues), 0.0
    for rank, i in enumerate(sorted(idx, key=lambda i: pvalues[i])):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        out[i] = running
    return out


def cmh(strata: list[tuple[float, float, float, float]]) -> tuple[float, float, float]:
    """Cochran–Mantel–Haenszel test of two arms' event rates, stratified by seed: strata of (events_a, units_a,
    events_b, units_b). Returns the Mantel–Haenszel common odds ratio (a over b), the continuity-corrected chi^2
    (1 df) and its p-value; NaN where no stratum has both events and non-events. It assumes independent decisions
    within a stratum, which clip decisions are not (a mini-batch's rollouts share one update; under token IS the
    units are tokens of one rollout): the seed-level tests are primary, this one is read beside them."""
    num = den = dev = var = 0.0
    for ea, ua, eb, ub in strata:
        total, events = ua + ub, ea + eb
        if total < 2 or events in (0, total):
            continue
        num += ea * (ub - eb) / total
        den += eb * (ua - ea) / total
        dev += ea - ua * events / total
        var += ua * ub * events * (total - events) / (total**2 * (total - 1))
    if var == 0:
        return float("nan"), float("nan"), float("nan")
    chi2 = (abs(dev) - 0.5) ** 2 / var if abs(dev) > 0.5 else 0.0
    odds = num / den if den > 0 else float("inf")
    return odds, chi2, float(stats.chi2.sf(chi2, 1))


def mh_odds_interval(strata: list[tuple[float, float, float, float]],
                     level: float = LEVEL) -> tuple[float, float]:
    """The Robins–Breslow–Greenland interval of the Mantel–Haenszel odds ratio (same strata as cmh; same
    independence assumption). [0, inf] where the odds ratio is 0 or infinite."""
    r_sum = s_sum = pr = ps_qr = qs = 0.0
    for ea, ua, eb, ub in strata:
        n = ua + ub
        if n < 1:
            continue
        a, b, c, d = ea, ua - ea, eb, ub - eb
        p, q, r, s_ = (a + d) / n, (b + c) / n, a * d / n, b * c / n
        r_sum, s_sum = r_sum + r, s_sum + s_
        pr, ps_qr, qs = pr + p * r, ps_qr + p * s_ + q * r, qs + q * s_
    if r_sum == 0 or s_sum == 0:  # an odds ratio of 0 or infinity: its log has no variance, the interval no bound
        return 0.0, float("inf")
    var = pr / (2 * r_sum**2) + ps_qr / (2 * r_sum * s_sum) + qs / (2 * s_sum**2)
    z = stats.norm.ppf((1 + level) / 2)
    log_or = math.log(r_sum / s_sum)
    return math.exp(log_or - z * math.sqrt(var)), math.exp(log_or + z * math.sqrt(var))


def stars(p: float) -> str:
    """The paper's marks: * p < 0.05, ** p < 0.01, *** p < 0.001."""
    if not math.isfinite(p):
        return ""
    return "***" if p < 0.001 else "**" if p < 0.01 else "*" if p < 0.05 else ""


# ------------------------------------------------------------------------------------------------- inputs
