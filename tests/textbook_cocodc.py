"""Numpy textbook loop of CoCoDC as reconstructed in docs/algorithms/cocodc.md.

The shape of ``textbook.streaming_nesterov`` (float64, plain loops, every replica's local
parameters at the end of each round), with each replica's fragment recorded at its send and
the drift since then carried onto the new global copy at its apply. Nothing here imports
co2jax.
"""

from __future__ import annotations

import numpy as np


def cocodc_nesterov(
    problem, lr, H, rounds, fragments, tau, alpha, eta, mu, correction, hessian_scale=0.5
):
    """Fragment p (flat indices) applied after (p+1)*H//P steps and sent tau steps earlier;
    Nesterov per fragment on the global copy (b <- mu*b + g; glob <- glob - eta*(g + mu*b),
    g the replicas' mean pseudo-gradient); then per replica, with y its fragment at the send,
    x now and d = x - y:

        none:   c = glob                                   (Streaming DiLoCo)
        zeroth: c = glob + d
        first:  c = glob + d + hessian_scale * g * g * d
        x <- alpha * x + (1 - alpha) * c

    Returns ``(trajectory [rounds, R, dim], largest |c - glob| seen)``: the size of the
    correction, so that a test can check it is not zero."""
    R, P = problem.replicas, len(fragments)
    local = [problem.theta0.copy() for _ in range(R)]
    glob = problem.theta0.copy()
    b = [np.zeros(len(idx)) for idx in fragments]
    apply_at = [(p + 1) * H // P for p in range(P)]
    send_at = [a - tau for a in apply_at]
    pending, sent, out, largest = {}, {}, [], 0.0
    for _ in range(rounds):
        for k in range(H + 1):
            for p, idx in enumerate(fragments):
                if send_at[p] == k:
                    pending[p] = np.mean([glob[idx] - local[r][idx] for r in range(R)], axis=0)
                    sent[p] = [local[r][idx].copy() for r in range(R)]
                if apply_at[p] == k:
                    g = pending.pop(p)
                    b[p] = mu * b[p] + g
                    glob[idx] = glob[idx] - eta * (g + mu * b[p])
                    y = sent.pop(p)
                    for r in range(R):
                        d = local[r][idx] - y[r]
                        if correction == "none":
                            c = glob[idx]
                        elif correction == "zeroth":
                            c = glob[idx] + d
                        elif correction == "first":
                            c = glob[idx] + d + hessian_scale * g * g * d
                        else:
                            raise ValueError(f"unknown correction {correction!r}")
                        largest = max(largest, float(np.abs(c - glob[idx]).max()))
                        local[r][idx] = alpha * local[r][idx] + (1 - alpha) * c
            if k < H:
                local = [x - lr * problem.grad(r, x) for r, x in enumerate(local)]
        out.append(np.stack(local))
    return np.array(out), largest
