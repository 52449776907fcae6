"""Numpy textbook loops of DiLoCo on low-rank pseudo-gradients with error feedback, and of
DiLoCoX (one round of delay, int4 factors), in float64 and plain loops. Nothing here imports
co2jax; the first ``Q`` of every factored leaf is an argument (``q0``).

Per replica r and round t, with the payload ``X_r`` (``Delta_r^(t - delay)``, zero before
round ``delay``) and the residual ``e_r``:

    T = X_r + decay * e_r                              (a flat vector, cut into leaves)
    per leaf of 2+ axes with (m + n) r < m n, M = the leaf as [shape[0], rest]:
        P  = orth(M Q_r)      QR, columns signed so that diag(R) >= 0; M Q = 0: unit vectors
        Q' = M^T P
        approximation P Q'^T  (int4: P^T, Q'^T and the dense leaves each rounded per block)
        Q_r <- Q' unless Q' is all zero
    other leaves: sent as they are (int4: rounded)
    e_r <- T - approximation
    g = mean_r approximation_r;  if t >= delay: b <- mu*b + g; theta <- theta - eta*(g + mu*b)
"""

from __future__ import annotations

import numpy as np
from textbook import Problem, inner_sgd, split_leaves


def factored(shape, rank: int) -> bool:
    if len(shape) < 2:
        return False
    m, n = shape[0], int(np.prod(shape[1:]))
    return (m + n) * rank < m * n


def orth(p: np.ndarray) -> np.ndarray:
    if not np.any(p != 0):
        return np.eye(*p.shape)
    q, r = np.linalg.qr(p)
    return q * np.where(np.diag(r) < 0, -1.0, 1.0)


def int4_roundtrip(x: np.ndarray, block: int) -> np.ndarray:
    """Symmetric int4 per block of ``block`` (zero-padded): s = max|x| / 7, round half to
    even, codes clipped to [-7, 7]."""
    n = x.size
    xb = np.pad(x, (0, (-n) % block)).reshape(-1, block)
    s = np.abs(xb).max(axis=1, keepdims=True) / 7.0
    q = np.clip(np.round(xb / np.where(s > 0, s, 1.0)), -7, 7)
    return (q * s).reshape(-1)[:n]


def compress(target, shapes, qs, rank, factors="float32", block=128):
    """One replica's approximation of ``target`` (flat) and its next ``qs``."""
    leaves = split_leaves(target, shapes)
    found, qs, j = [], list(qs), 0  # found: (leaf, P, Q') or (leaf, None, values)
    for i, (x, shape) in enumerate(zip(leaves, shapes, strict=True)):
        if not factored(shape, rank):
            found.append((i, None, x.reshape(-1)))
            continue
        m = x.reshape(shape[0], -1)
        p = orth(m @ qs[j])
        q_next = m.T @ p
        found.append((i, p, q_next))
        qs[j] = q_next if np.any(q_next != 0) else qs[j]
        j += 1
    if factors == "int4":  # three vectors, each rounded on its own: P^T's, Q'^T's, dense

        def rounded(vectors):
            if not vectors:
                return []
            flat = int4_roundtrip(np.concatenate([v.reshape(-1) for v in vectors]), block)
            return split_leaves(flat, [v.shape for v in vectors])

        fact = [(i, p, v) for i, p, v in found if p is not None]
        dense = [(i, v) for i, p, v in found if p is None]
        by_leaf = {}
        ps, qts = rounded([p.T for _, p, _ in fact]), rounded([v.T for _, _, v in fact])
        for (i, _, _), pt, qt in zip(fact, ps, qts, strict=True):
            by_leaf[i] = (i, pt.T, qt.T)
        for (i, _), d in zip(dense, rounded([v for _, v in dense]), strict=True):
            by_leaf[i] = (i, None, d)
        found = [by_leaf[i] for i in range(len(found))]
    elif factors != "float32":
        raise ValueError(f"factors={factors!r}: the textbook has float32 and int4")
    out = [p @ v.T if p is not None else v for _, p, v in found]
    return np.concatenate([o.reshape(-1) for o in out]), qs


def diloco_low_rank(
    problem: Problem,
    lr,
    H,
    rounds,
    eta,
    mu,
    shapes,
    rank,
    q0,
    *,
    delay=0,
    decay=1.0,
    factors="float32",
    block=128,
    warm=True,
):
    """Returns ``(anchors [rounds, R, dim], {"residuals": [R, dim], "factors": per round,
    per replica, the list of Q})``. ``warm=False``: every round restarts from ``q0``."""
    R, dim = problem.replicas, problem.theta0.size
    anchor, b = problem.theta0.copy(), np.zeros(dim)
    e = [np.zeros(dim) for _ in range(R)]
    qs = [[np.array(q, np.float64) for q in q0] for _ in range(R)]
    pending = [[np.zeros(dim) for _ in range(delay)] for _ in range(R)]
    out, history = [], []
    for t in range(rounds):
        deltas = [anchor - inner_sgd(problem, r, anchor, lr, H) for r in range(R)]
        sent = []
        for r in range(R):
            payload = pending[r][0] if delay else deltas[r]
            target = payload + decay * e[r]
            start = qs[r] if warm else [np.array(q, np.float64) for q in q0]
            approx, qs[r] = compress(target, shapes, start, rank, factors, block)
            e[r] = target - approx
            sent.append(approx)
            if delay:
                pending[r] = [*pending[r][1:], deltas[r]]
        g = np.mean(sent, axis=0)
        if t >= delay:
            b = mu * b + g
            anchor = anchor - eta * (g + mu * b)
        out.append(np.stack([anchor] * R))
        history.append([[q.copy() for q in qr] for qr in qs])
    return np.array(out), {"residuals": np.stack(e), "factors": history}


def diloco_x(problem, lr, H, rounds, eta, mu, shapes, rank, q0, *, delay=1, **kw):
    """DiLoCoX as reconstructed: one round of delay, int4 factors (block 128 by default)."""
    return diloco_low_rank(
        problem, lr, H, rounds, eta, mu, shapes, rank, q0, delay=delay, factors="int4", **kw
    )
