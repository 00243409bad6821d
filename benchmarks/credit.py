"""Vectorized reshape_advantages against a plain per-trajectory loop, side by side.

    python benchmarks/credit.py

Prints the time of each and the ratio at B=4096 x K=50 turns and at B=256 x T=4096 tokens
(per-token accumulation). Target: >= 100x at 4096 x 50.
"""

from __future__ import annotations

import time

import torch

from agentopsd.credit import reshape_advantages


def loop_reshape(adv, gaps, mask, prior, gamma=0.95, lam=0.5, band=0.2):
    """The spec, one trajectory at a time (what a straightforward implementation does)."""
    out = torch.zeros_like(gaps)
    for i in range(gaps.shape[0]):
        n = int(mask[i].sum())
        if n == 0:
            continue
        p = prior[i].clamp(1e-4, 1 - 1e-4)
        l0 = torch.log(p / (1 - p))
        c = torch.zeros((), dtype=gaps.dtype)
        prev = torch.sigmoid(l0)
        q = torch.empty(n, dtype=gaps.dtype)
        for k in range(n):
            c = gamma * c + gaps[i, k]
            b = torch.sigmoid(l0 + c)
            q[k] = torch.sign(adv[i]) * (b - prev)
            prev = b
        z = (q - q.mean()) / (q.std(unbiased=False) + 1e-4)
        w = (1 + band * z).clamp(1 - band, 1 + band)
        out[i, :n] = adv[i] * ((1 - lam) + lam * w)
    return out


def batch(b, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, k + 1, (b,), generator=g)
    mask = torch.arange(k)[None] < lengths[:, None]
    return torch.randn(b, generator=g), torch.randn(b, k, generator=g), mask, torch.rand(b, generator=g)


def timed(fn, repeats):
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    for name, (b, k) in {"turns 4096 x 50": (4096, 50), "tokens 256 x 4096": (256, 4096)}.items():
        adv, gaps, mask, prior = batch(b, k)
        args = (adv, gaps, mask, prior)
        t_vec, fast = timed(lambda a=args: reshape_advantages(*a), 5)
        t_loop, slow = timed(lambda a=args: loop_reshape(*a), 1)
        err = (fast - slow).abs().max().item()
        print(f"{name:>18}: vectorized {t_vec * 1e3:8.2f} ms | loop {t_loop * 1e3:10.1f} ms | ratio {t_loop / t_vec:8.1f}x | max diff {err:.2e}")


if __name__ == "__main__":
    main()
