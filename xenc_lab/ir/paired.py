"""Paired significance tests between two systems' per-query values, and the multiple-testing corrections of
statsmodels' ``multipletests``: the statistics behind ``experiment``'s ``{m} p-value`` columns."""
from __future__ import annotations

import numpy as np

TESTS = ("t", "randomization", "wilcoxon")


def check_test(test):
    """``test`` as given, if it is a known name or a callable ``(system, baseline) -> p-value``."""
    if callable(test) or test in TESTS:
        return test
    raise ValueError(f"test must be one of {list(TESTS)} or a function (system values, baseline values) -> p-value, "
                     f"got {test!r}")


def paired_pvalue(system: np.ndarray, base: np.ndarray, test="t", trials: int = 10000, seed: int = 0) -> float:
    """The two-sided p-value of ``system`` against ``base`` (paired per-query values): ``"t"`` is
    ``scipy.stats.ttest_rel``, ``"randomization"`` a paired randomization test (``scipy.stats.permutation_test`` on
    the mean difference, ``trials`` resamples, ``seed``), ``"wilcoxon"`` ``scipy.stats.wilcoxon``; a function is
    called as ``test(system, base)`` and may return a number or an object with ``pvalue``. Where every difference
    is zero there is no evidence of one: 1.0 (scipy's t-test would give nan). Fewer than 2 queries: nan."""
    from scipy import stats

    system, base = np.asarray(system, dtype="float64"), np.asarray(base, dtype="float64")
    if len(system) < 2:
        return float("nan")
    if callable(test):
        out = test(system, base)
        return float(getattr(out, "pvalue", out))
    if np.array_equal(system, base):
        return 1.0
    if test == "t":
        return float(stats.ttest_rel(system, base).pvalue)
    if test == "wilcoxon":
        return float(stats.wilcoxon(system, base).pvalue)
    perm = stats.permutation_test((system, base), _mean_difference, permutation_type="samples", vectorized=True,
                                  n_resamples=trials, alternative="two-sided", rng=seed)
    return float(perm.pvalue)


def _mean_difference(x, y, axis):
    return np.mean(x - y, axis=axis)


def corrected(pvalues, method: str, alpha: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """(reject, corrected p-values) of statsmodels' ``multipletests(pvalues, alpha, method)``; nan p-values (fewer
    than 2 queries) stay nan and are not rejected, the others corrected among themselves."""
    from statsmodels.stats.multitest import multipletests

    p = np.asarray(pvalues, dtype="float64")
    reject, adjusted = np.zeros(len(p), dtype=bool), np.full(len(p), np.nan)
    ok = ~np.isnan(p)
    if ok.any():
        reject[ok], adjusted[ok] = multipletests(p[ok], alpha=alpha, method=method)[:2]
    return reject, adjusted


def check_correction(method):
    """``method`` if statsmodels' ``multipletests`` knows it (or None: no correction)."""
    if method is None:
        return None
    try:
        from statsmodels.stats.multitest import multipletests
    except ImportError:  # pragma: no cover - statsmodels comes with the 'ir' extra
        raise ImportError("a multiple-testing correction needs statsmodels: pip install 'xenc-lab[ir]' "
                          "(or pass correction=None)") from None
    try:
        multipletests([0.01, 0.02], method=method)
    except (ValueError, TypeError):
        raise ValueError(f"correction must be a statsmodels multipletests method ('holm', 'bonferroni', 'fdr_bh', "
                         f"'holm-sidak', 'hs', 'sidak', 'fdr_by'...) or None, got {method!r}") from None
    return method
