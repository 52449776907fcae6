"""Numpy textbook loops of SPARTA and SPARTA-DiLoCo (docs/algorithms/sparta.md), in float64.

Every inner step each replica takes its SGD step, then, per leaf, the entries ``draw(t, leaf,
n)`` names (flat indices within the leaf, ``None`` for all of them; ``t`` the steps taken
before this one) are replaced by their mean over the replicas. SPARTA-DiLoCo adds DiLoCo's
outer Nesterov step after every H-th step. The draws are the caller's (the tests pass JAX's
PRNG draws: the rule's randomness, not its math); nothing here imports co2jax. Signature of
``tests/textbook.py``'s loops plus the draw: ``[rounds, R, dim]``, what each replica starts
the next round from.
"""

from __future__ import annotations

import numpy as np
from textbook import Problem


def sparta(problem: Problem, lr, H, rounds, draw, sizes, every=1, outer=None) -> np.ndarray:
    """``outer``: ``(eta, mu)`` of DiLoCo's outer Nesterov step every H steps, or ``None``."""
    R = problem.replicas
    x = [problem.theta0.copy() for _ in range(R)]
    anchor, b, t, out = problem.theta0.copy(), 0.0, 0, []
    for _ in range(rounds):
        for _ in range(H):
            x = [x[r] - lr * problem.grad(r, x[r]) for r in range(R)]
            if t % every == 0:
                offset = 0
                for leaf, n in enumerate(sizes):
                    idx = draw(t, leaf, n)
                    chosen = offset + (np.arange(n) if idx is None else np.asarray(idx))
                    mean = np.mean([x[r][chosen] for r in range(R)], axis=0)
                    for r in range(R):
                        x[r][chosen] = mean
                    offset += n
            t += 1
        if outer is not None:
            eta, mu = outer
            delta = anchor - np.mean(x, axis=0)
            b = mu * b + delta
            anchor = anchor - eta * (delta + mu * b)
            x = [anchor.copy() for _ in range(R)]
        out.append(np.stack(x))
    return np.array(out)
