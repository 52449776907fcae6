"""Numpy textbook loops with per-round participation: weights w[t][r] >= 0 (0 leaves replica
r out of round t's reduction) and per-replica inner step counts n[t][r]. Every replica
continues from the anchor the participants produce. Nothing here imports co2jax."""

from __future__ import annotations

import numpy as np
from textbook import _topk_ternary, inner_sgd, streaming_nesterov, weighted_mean


def diloco(problem, lr, H, rounds, eta, mu, weights, steps=None, delay=0):
    """DiLoCo (Nesterov outer step) whose round-t reduction is the w[t]-weighted mean of the
    payloads sent in it: this round's pseudo-gradients, or (``delay``) those of round
    t - delay. Replica r takes n[t][r] inner steps (default H)."""
    R = problem.replicas
    anchor, b, own, out = problem.theta0.copy(), 0.0, [], []
    for t in range(rounds):
        n = steps[t] if steps is not None else [H] * R
        own.append([anchor - inner_sgd(problem, r, anchor, lr, n[r]) for r in range(R)])
        if t >= delay:
            g = weighted_mean(own[t - delay], weights[t])
            b = mu * b + g
            anchor = anchor - eta * (g + mu * b)
        out.append(np.stack([anchor] * R))
    return np.array(out)


def streaming(problem, lr, H, rounds, fragments, tau, alpha, eta, mu, weights):
    """Streaming DiLoCo (``textbook.streaming_nesterov``) with every fragment of round t
    reduced with weights w[t]."""
    return streaming_nesterov(
        problem, lr, H, rounds, fragments, tau, alpha, eta, mu, weights=weights
    )


def sparseloco(problem, lr, H, rounds, alpha, beta, k, chunk, weights, poisoned=()):
    """SparseLoCo (``textbook.sparseloco``) whose contributor mean at round t is weighted:
    per index, sum_r w_r sent_r / sum_{r that sent it} w_r. Every replica's error feedback
    runs as usual (a left-out replica's sent values are lost to it). Replica r's batch of
    round t is poisoned for every (t, r) in ``poisoned``: it sends nothing that round, and
    its error feedback restarts from 0 (a residual with a NaN would poison every payload)."""
    R = problem.replicas
    anchor, out = problem.theta0.copy(), []
    e = [np.zeros_like(anchor) for _ in range(R)]
    for t in range(rounds):
        total, count = np.zeros_like(anchor), np.zeros_like(anchor)
        for r in range(R):
            if (t, r) in poisoned:
                e[r] = np.zeros_like(anchor)
                continue
            e[r] = beta * e[r] + (anchor - inner_sgd(problem, r, anchor, lr, H))
            sent, support = _topk_ternary(e[r], k, chunk, True)
            e[r] = e[r] - sent
            total, count = total + weights[t][r] * sent, count + weights[t][r] * support
        anchor = anchor - alpha * np.where(count > 0, total / np.where(count > 0, count, 1), 0)
        out.append(np.stack([anchor] * R))
    return np.array(out)


def diloco_poisoned(problem, lr, beta, H, rounds, eta, mu, poisoned, delay=0):
    """DiLoCo (Nesterov outer step, ``delay`` rounds late) over inner heavy-ball SGD (m <- g +
    beta m; theta <- theta - lr m, m kept from round to round), where replica r's batch of
    round t is poisoned for every (t, r) in ``poisoned``: its pseudo-gradient of round t is
    left out of the reduction that carries it (round t + delay), and it restarts round t + 1
    from the anchor with m = 0. Every other replica's momentum runs on."""
    R = problem.replicas
    anchor, b, out = problem.theta0.copy(), 0.0, []
    m = [np.zeros_like(anchor) for _ in range(R)]
    own = []
    for t in range(rounds):
        deltas = []
        for r in range(R):
            if (t, r) in poisoned:
                m[r] = np.zeros_like(anchor)
                deltas.append(np.zeros_like(anchor))
                continue
            theta = anchor.copy()
            for _ in range(H):
                m[r] = problem.grad(r, theta) + beta * m[r]
                theta = theta - lr * m[r]
            deltas.append(anchor - theta)
        own.append(deltas)
        if t >= delay:
            w = [0.0 if (t - delay, r) in poisoned else 1.0 for r in range(R)]
            g = weighted_mean(own[t - delay], w)
            b = mu * b + g
            anchor = anchor - eta * (g + mu * b)
        out.append(np.stack([anchor] * R))
    return np.array(out)
