"""The statistics of the seed comparisons: intervals and tests that take numbers, not runs (gapo-compare seeds'
tables and the laptop experiment's endpoints both use them). Each is checked against an independent computation in
tests/test_compare.py."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

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


# --------------------------------------------------------------------------- one metric over seeds, one label
@dataclass(frozen=True)
class Estimate:
    """One label's values of one metric, one per seed: mean ± a Student-t interval (the paper's Table 6), for
    quantities without bounds (entropy, lengths, correlations). `seeds` (trainer.seed of each value's run, same
    order) is what pairs two labels' values: same-seed runs share prompt order, sampling and evaluation seeds."""

    values: tuple[float, ...]
    seeds: tuple[int, ...] = ()

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return float(np.mean(self.values))

    @property
    def centre(self) -> float:
        """What a cell shows as the estimate: inside interval() whenever that is defined."""
        return self.mean

    @property
    def half_width(self) -> float:
        """t_{0.975, n-1} * s / sqrt(n), s the sample standard deviation: the paper's Table 6 interval.
        NaN below two seeds, where the spread, and so the interval, is undefined."""
        return ci_half_width(self.values)

    def interval(self, level: float = LEVEL) -> tuple[float, float]:
        h = ci_half_width(self.values, level)
        return self.mean - h, self.mean + h

    def by_seed(self) -> dict[int, float]:
        return dict(zip(self.seeds, self.values, strict=True))


@dataclass(frozen=True)
class ProportionEstimate(Estimate):
    """A fraction per seed (pass@k, a clip fraction), whose interval must stay in [0, 1].

    Without counts (pass@k per seed): the centre is the back-transformed mean logit over seeds (so it lies inside
    its interval: a Student-t interval on the logit scale, df = n - 1, mapped back); fractions are held within
    [1e-3, 1 - 1e-3]; seeds that all agree give the value with a zero-width interval (no spread to estimate). Its
    estimand is a typical seed's fraction on the logit scale; Δ between labels is of arithmetic means (`mean`).

    With `counts` (events, units) per seed (clip decisions): the estimand is the pooled fraction, events over units
    summed over seeds (a decision-weighted rate), and the interval is the hull of three, each covering where the
    others fail. Clopper–Pearson on the pooled counts: exact if decisions were independent, never zero width. The
    seed-clustered (sandwich) standard error, Student-t with df = n - 1 on the logit scale: the seeds as the
    units, the t quantile paying for few of them; it carries large counts, where the seeds' spread is measured
    well but few seeds make a chi-square calibration too narrow. The beta-binomial profile-likelihood interval
    (each seed's rate from a beta with the mean and an intraclass correlation that is profiled out; chi-square,
    1 df): sparse counts, where the sandwich's spread comes from the one or two seeds that clipped, and no seed
    clipping at all, which cannot rule out seeds that clip all or nothing (its upper bound is then
    1 - exp(-q / 2n), q the chi-square quantile: 0.32 at 5 seeds, 0.17 at 10). One seed cannot show how seeds
    spread, so its interval is that profile's, wider than Clopper–Pearson on its counts.

    Coverage of the nominal 95 %, measured with the simulation of tests/test_compare.py (2000 seeded draws per
    setting; median width in brackets): a 10 % rate, 11-19 decisions per seed, each seed's rate from a beta with
    the given intraclass correlation. 5 seeds: 0.991 (0.19) at ICC 0, 0.996 (0.42) at 0.3, 0.996 (0.45) at 0.5;
    10 seeds: 0.980 (0.11), 0.942 (0.25), 0.947 (0.34). The hull of the first two alone: 0.990, 0.926, 0.799 and
    0.980, 0.917, 0.867 at the same widths give or take 0.004, nearly all its misses samples where no seed, or
    one or two, clipped. At 500-1500 decisions per seed, 3 or 5 seeds, ICC 0 to 0.02 (500 draws), the profile
    alone covered 0.84-0.98 and the hull 0.94-0.99. At 2-7 decisions per seed and 5 seeds the first two alone
    covered 0.98-0.99; the clustered one alone was measured at 0.58 at a 4 % rate.

    Why not a bootstrap over seeds: with 5 seeds its percentile interval covered 0.84 at ICC 0 and 0.61 at 0.5 (a
    resample of seeds that never clipped has no spread). Why not a Bayesian beta-binomial with a flat prior on the
    intraclass correlation: it covered, but at 3 seeds of 100 000 tokens whose rates agree to ±0.4 % its interval
    was 0.07-0.31, the prior's weight on large correlations outweighing what the seeds show."""

    counts: tuple[tuple[float, float], ...] = ()

    def _logits(self) -> np.ndarray:
        p = np.clip(np.asarray(self.values, dtype=float), 1e-3, 1 - 1e-3)
        return np.log(p / (1 - p))

    def _pooled(self) -> tuple[float, float, float]:
        """Events, units and the seed-clustered standard error of their ratio:
        Var = n/(n-1) sum_i (e_i - p u_i)^2 / U^2 (NaN at one seed)."""
        e, u = (np.array(x, dtype=float) for x in zip(*self.counts, strict=True))
        p, n = e.sum() / u.sum(), len(u)
        se = math.sqrt(n / (n - 1) * ((e - p * u) ** 2).sum()) / u.sum() if n > 1 else float("nan")
        return float(e.sum()), float(u.sum()), se

    @property
    def constant(self) -> bool:
        return self.n > 0 and bool(np.ptp(self.values) == 0)

    @property
    def centre(self) -> float:
        if self.n == 0:
            return float("nan")
        if self.counts:
            events, units, _ = self._pooled()
            return events / units
        if self.n == 1 or self.constant:
            return float(self.values[0])
        return float(1 / (1 + math.exp(-self._logits().mean())))

    def interval(self, level: float = LEVEL) -> tuple[float, float]:
        if self.counts and self.n:
            events, units, se = self._pooled()
            lo, hi = clopper_pearson(events, units, level)
            p = events / units
            if self.n > 1 and 0 < p < 1 and se > 0:  # the delta method: d logit(p) / dp = 1 / (p (1 - p))
                t = stats.t.ppf((1 + level) / 2, self.n - 1)
                mid, h = math.log(p / (1 - p)), t * se / (p * (1 - p))
                lo, hi = min(lo, expit(mid - h)), max(hi, expit(mid + h))
            blo, bhi = beta_binomial_interval(self.counts, level)
            return min(lo, blo), max(hi, bhi)
        if self.n < 2:
            return float("nan"), float("nan")
        if self.constant:
            return self.centre, self.centre
        t = stats.t.ppf((1 + level) / 2, self.n - 1)
        z = self._logits()
        mid, h = z.mean(), t * z.std(ddof=1) / math.sqrt(len(z))
        return expit(mid - h), expit(mid + h)


def paired_differences(a: Estimate, b: Estimate) -> tuple[list[int], np.ndarray]:
    """The seeds both labels have (by trainer.seed, never by list position: a missing seed would shift every later
    pair) and a - b at each."""
    ab, bb = a.by_seed(), b.by_seed()
    common = sorted(set(ab) & set(bb))
    return common, np.array([ab[s] - bb[s] for s in common], dtype=float)
