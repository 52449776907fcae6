"""Numpy textbook loop of DES-LOC (docs/algorithms/desloc.md), in float64: every replica runs
its own Adam (optax.adam's rule, bias correction from its own step count); after step k
(1-based) the first moments are replaced by their replica mean when K_u divides k, the
second moments when K_v does; after every H-th step the parameters are (Local SGD's round).
Nothing here imports co2jax; the signature is tests/textbook.py's plus the periods."""

from __future__ import annotations

import numpy as np
from textbook import Problem


def desloc_adam(
    problem: Problem, lr, H, rounds, first_every, second_every, b1=0.9, b2=0.999, eps=1e-8
) -> np.ndarray:
    """``[rounds, R, dim]``: what each replica starts the next round from. A period of 0
    never averages."""
    R, dim = problem.replicas, problem.d.shape[1]
    x = [problem.theta0.copy() for _ in range(R)]
    m, v = np.zeros((R, dim)), np.zeros((R, dim))
    k, out = 0, []
    for _ in range(rounds):
        for _ in range(H):
            k += 1
            for r in range(R):
                g = problem.grad(r, x[r])
                m[r] = b1 * m[r] + (1 - b1) * g
                v[r] = b2 * v[r] + (1 - b2) * g * g
                m_hat, v_hat = m[r] / (1 - b1**k), v[r] / (1 - b2**k)
                x[r] = x[r] - lr * m_hat / (np.sqrt(v_hat) + eps)
            if first_every and k % first_every == 0:
                m[:] = m.mean(axis=0)
            if second_every and k % second_every == 0:
                v[:] = v.mean(axis=0)
        anchor = np.mean(x, axis=0)
        x = [anchor.copy() for _ in range(R)]
        out.append(np.stack(x))
    return np.array(out)
