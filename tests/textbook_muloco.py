"""Numpy textbook loops of MuLoCo (docs/algorithms/muloco.md), in float64: the released Muon
step (torch layout, weight ``(fan_out, fan_in)``) and DiLoCo with error feedback whose residual
carries the outer learning rate. Nothing here imports co2jax."""

from __future__ import annotations

import numpy as np
from textbook import Problem, int8_roundtrip

COEFFICIENTS = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)


def newton_schulz(u: np.ndarray, eps: float = 1e-7) -> np.ndarray:
    """The released zeropower step (in float64 here; the release casts to bfloat16):
    transpose a tall matrix, divide by the Frobenius norm + eps, five quintic steps."""
    x = np.asarray(u, np.float64)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (np.linalg.norm(x) + eps)
    for a, b, c in COEFFICIENTS:
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def muon_step(w, g, m, lr, mu=0.9, nesterov=False, wd=0.0, scale="spectral"):
    """One released Muon step on ``w`` of shape (fan_out, fan_in): ``(w, m)``."""
    m = mu * m + g
    u = mu * m + g if nesterov else m
    o = newton_schulz(u)
    fan_out, fan_in = w.shape
    s = np.sqrt(fan_out / fan_in) if scale == "spectral" else 0.2 * np.sqrt(max(w.shape))
    return w * (1 - lr * wd) - lr * s * o, m


def diloco_feedback(
    problem: Problem, lr, H, rounds, eta, mu, decay, block, scale_by_eta=True, inner=None
) -> np.ndarray:
    """DiLoCo with error feedback on int8 pseudo-gradients: per replica
    ``e <- decay e + s Delta_r`` (``s`` = eta as released, or 1), ``c = C(e)``,
    ``e <- e - c``; then Nesterov(eta, mu) on ``mean_r c``. ``inner(r, theta, H)`` runs a
    replica's H inner steps (default: SGD at ``lr``)."""
    from textbook import inner_sgd

    R = problem.replicas
    run = inner or (lambda r, theta, steps: inner_sgd(problem, r, theta, lr, steps))
    anchor, b, out = problem.theta0.copy(), 0.0, []
    e = [np.zeros_like(anchor) for _ in range(R)]
    s = eta if scale_by_eta else 1.0
    for _ in range(rounds):
        sent = []
        for r in range(R):
            target = s * (anchor - run(r, anchor, H)) + decay * e[r]
            c = int8_roundtrip(target, block).astype(np.float64)
            e[r] = target - c
            sent.append(c)
        g = np.mean(sent, axis=0)
        b = mu * b + g
        anchor = anchor - eta * (g + mu * b)
        out.append(np.stack([anchor] * R))
    return np.array(out)
