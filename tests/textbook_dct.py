"""Numpy textbook loops of DeMo and DCT-momentum DiLoCo (docs/algorithms/demo.md,
docs/algorithms/dct_diloco.md), in float64 and plain loops over chunks.

The DCT of a chunk is ``scipy.fft.dctn(tile, norm="ortho")`` (of a 1-D chunk, the 1-D DCT);
nothing here imports co2jax. Each loop has the signature of ``tests/textbook.py``'s:
``(problem, lr, H, rounds) -> [rounds, R, dim]``, what each replica starts the next round from
(DeMo: its parameters after every H-th step). The flat parameter vector is cut into leaves of
``shapes`` in order, each row-major (the default is ``tests/harness.py::unflatten`` for dim
16: ``b`` of 2, ``w`` of 14).
"""

from __future__ import annotations

import math

import numpy as np
import scipy.fft
from textbook import Problem, inner_sgd, split_leaves

DEFAULT_SHAPES = ((2,), (14,))


def largest_divisor(n: int, target: int) -> int:
    """The released code's chunk size: the largest divisor of n that is <= target."""
    return n if n <= target else max(d for d in range(1, target + 1) if n % d == 0)


def _matrix(shape):
    return (shape[0], math.prod(shape[1:])) if len(shape) > 2 else tuple(shape)


def _tiles(shape, chunk):
    """The slices of every chunk of a leaf's matrix view, row-major over the tiling."""
    m = _matrix(shape)
    sizes = [largest_divisor(n, chunk) for n in m]
    ranges = [[slice(i, i + s) for i in range(0, n, s)] for n, s in zip(m, sizes, strict=True)]
    if len(m) == 1:
        return [(r,) for r in ranges[0]]
    return [(a, b) for a in ranges[0] for b in ranges[1]]


def compress(leaf: np.ndarray, k: int, chunk: int):
    """Per chunk: (its DCT coefficients with all but the k largest |.| zeroed, the 0/1 mask
    of the kept ones), flattened row-major within the chunk."""
    m = leaf.reshape(_matrix(leaf.shape))
    out = []
    for tile in _tiles(leaf.shape, chunk):
        c = scipy.fft.dctn(m[tile], type=2, norm="ortho").reshape(-1)
        keep = np.argsort(-np.abs(c), kind="stable")[: min(k, c.size)]
        q, mask = np.zeros_like(c), np.zeros_like(c)
        q[keep], mask[keep] = c[keep], 1.0
        out.append((q, mask))
    return out


def decompress(coefficients, shape, chunk: int) -> np.ndarray:
    """The leaf whose chunks have these (flat) DCT coefficients."""
    m = np.zeros(_matrix(shape))
    for tile, c in zip(_tiles(shape, chunk), coefficients, strict=True):
        m[tile] = scipy.fft.idctn(c.reshape(m[tile].shape), type=2, norm="ortho")
    return m.reshape(shape)


def _flat(leaves):
    return np.concatenate([x.reshape(-1) for x in leaves])


def sparse_round(deltas, k, chunk, shapes=DEFAULT_SHAPES):
    """Every replica's IDCT(q_r) and the inverse DCT of the contributor mean of the q_r, as
    flat vectors."""
    R = len(deltas)
    shared, sent = [], [[] for _ in range(R)]
    for j, s in enumerate(shapes):
        per_replica = [compress(split_leaves(deltas[r], shapes)[j], k, chunk) for r in range(R)]
        mean = []
        for c in range(len(per_replica[0])):
            total = sum(per_replica[r][c][0] for r in range(R))
            count = sum(per_replica[r][c][1] for r in range(R))
            mean.append(total / np.maximum(count, 1.0))
        shared.append(decompress(mean, s, chunk))
        for r in range(R):
            sent[r].append(decompress([q for q, _ in per_replica[r]], s, chunk))
    return [_flat(x) for x in sent], _flat(shared)


def dct_diloco(
    problem: Problem, lr, H, rounds, eta=0.7, beta=0.95, k=32, chunk=64, shapes=None, weights=None
):
    """Per replica r: g_r = w_r (phi_r - theta_r); delta_r <- beta delta_r + g_r;
    q_r = TopK(DCT(delta_r)); delta_r -= IDCT(q_r); delta_r += IDCT(contributor mean of q);
    phi_r <- phi_r - eta (g_r + beta delta_r). Returns the anchors phi_r (replica-local)."""
    shapes = DEFAULT_SHAPES if shapes is None else shapes
    R = problem.replicas
    weights = [1.0] * R if weights is None else weights
    anchors = [problem.theta0.copy() for _ in range(R)]
    deltas = [np.zeros_like(problem.theta0) for _ in range(R)]
    out = []
    for _ in range(rounds):
        g = [weights[r] * (anchors[r] - inner_sgd(problem, r, anchors[r], lr, H)) for r in range(R)]
        deltas = [beta * deltas[r] + g[r] for r in range(R)]
        sent, shared = sparse_round(deltas, k, chunk, shapes)
        for r in range(R):
            deltas[r] = deltas[r] - sent[r] + shared
            anchors[r] = anchors[r] - eta * (g[r] + beta * deltas[r])
        out.append(np.stack(anchors))
    return np.array(out)


def demo(problem: Problem, lr, H, rounds, beta=0.999, k=32, chunk=64, shapes=None, wd=0.0):
    """Every step on every replica: delta_r <- beta delta_r + lr g_r; q_r = TopK(DCT(delta_r));
    delta_r -= IDCT(q_r); u = IDCT(contributor mean of q); theta_r <- theta_r - lr wd theta_r
    - lr sign(u). Recorded every H steps. ``lr`` may be a function of the step (0, 1, ...)."""
    shapes = DEFAULT_SHAPES if shapes is None else shapes
    rate = lr if callable(lr) else (lambda t: lr)
    R = problem.replicas
    thetas = [problem.theta0.copy() for _ in range(R)]
    deltas = [np.zeros_like(problem.theta0) for _ in range(R)]
    out, t = [], 0
    for _ in range(rounds):
        for _ in range(H):
            a = rate(t)
            deltas = [beta * deltas[r] + a * problem.grad(r, thetas[r]) for r in range(R)]
            sent, u = sparse_round(deltas, k, chunk, shapes)
            for r in range(R):
                deltas[r] = deltas[r] - sent[r]
                thetas[r] = thetas[r] - a * wd * thetas[r] - a * np.sign(u)
            t += 1
        out.append(np.stack(thetas))
    return np.array(out)
