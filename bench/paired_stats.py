"""Summaries of paired ratios for the benchmark scripts (bench/redis,
bench/sampling): each ratio compares two runs made back to back, so the
machine's drift between pairs cancels; the median's confidence interval
says whether it is above a bound, not only its value."""
import statistics


def median_ci(xs):
    """Median of `xs` and a distribution-free ~95 % confidence interval for
    it: the order statistics n/2 -+ 0.98 sqrt(n) (the binomial's normal
    approximation), which assume nothing of the noise's shape."""
    xs = sorted(xs)
    n = len(xs)
    k = max(0, int(n / 2 - 0.98 * n ** 0.5))
    return statistics.median(xs), xs[k], xs[n - 1 - k]


def ratio_summary(rs):
    """One line: median, its confidence interval, the number of pairs and
    the range."""
    med, lo, hi = median_ci(rs)
    return (f"{med:.3f} (95 % CI {lo:.3f} - {hi:.3f}; {len(rs)} pairs, "
            f"range {min(rs):.3f} - {max(rs):.3f})")
