"""pass@k from n samples per problem, c of them correct.

The unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on
Code"): the chance that k samples drawn without replacement from the n include a correct
one, ``1 - C(n-c, k) / C(n, k)``, averaged over problems. The binomials overflow floats
for n in the hundreds, so the ratio is taken as the product ``prod_{i=n-c+1}^{n} (1 - k/i)``.
"""

from __future__ import annotations


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``c`` correct out of ``n`` samples."""
    if not 0 <= c <= n:
        raise ValueError(f"correct samples c={c} must be in [0, n={n}]")
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs k <= n samples per problem, got k={k} and n={n}: "
                         f"lower k or raise the number of samples")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    ratio = 1.0
    for i in range(n - c + 1, n + 1):
        ratio *= 1.0 - k / i
    return 1.0 - ratio


def default_ks(n: int) -> list[int]:
    """Powers of two below ``n``, and ``n`` itself: 1, 2, 4, 8, 16, 32 for n = 32."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def pass_at_ks(correct: list[int], n: int, ks: list[int]) -> dict[str, float]:
    """``{"pass@1": ..., "pass@k": ...}`` averaged over problems (``correct[i]`` of problem i).

    pass@1 is the mean correctness over all samples (boba's "averaged over samples"), which
    is the k = 1 case of the estimator.
    """
    if not correct:
        raise ValueError("pass@k over zero problems")
    out = {"pass@1": sum(correct) / (n * len(correct))}
    for k in ks:
        if k > 1:
            out[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in correct) / len(correct)
    return out
