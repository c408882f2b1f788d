"""The unbiased pass@k estimator of Chen et al. (2021), "Evaluating Large Language Models
Trained on Code": with n samples of which c pass, pass@k = 1 - C(n-c, k) / C(n, k)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from megacpp.errors import ConfigError

DEFAULT_KS = (1, 10, 100)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n passes.

    Computed as 1 - prod_{i=n-c+1..n} (1 - k/i), which never forms huge binomials.
    """
    if n < 1 or not 0 <= c <= n:
        raise ConfigError(f"pass@k needs n >= 1 and 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ConfigError(f"pass@{k} needs 1 <= k <= n (n={n} samples)")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def mean_pass_at_k(counts: Mapping[str, tuple[int, int]], ks: Iterable[int]) -> dict[int, float]:
    """Mean pass@k over problems, ``counts[task] = (n, c)``, for every k <= the smallest n.

    A k larger than some problem's sample count has no unbiased estimate and is left out.
    """
    if not counts:
        raise ConfigError("pass@k needs at least one problem with samples")
    smallest_n = min(n for n, _ in counts.values())
    return {
        k: sum(pass_at_k(n, c, k) for n, c in counts.values()) / len(counts)
        for k in sorted(set(ks))
        if k <= smallest_n
    }
