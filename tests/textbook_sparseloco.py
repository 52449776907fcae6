"""A numpy port of SparseLoCo's production quantizer and aggregation, as the authors' released
code runs them (``src/tplr/compress.py`` and the outer step of their trainer), and the full
SparseLoCo loop on the textbook problem. Plain loops; nothing here imports co2jax.

Per tensor: tiles (the largest divisor of each dimension up to the target), the top k of each
tile, one 4-bin quantizer over all the kept values, decode ``lookup[q] + shift``; the
aggregate clips each replica's decoded values to the median replica norm (``torch.median``:
the lower middle value) and takes the mean over the replicas that selected each index.
"""

from __future__ import annotations

import math

import numpy as np
from textbook import Problem, inner_sgd, split_leaves


def divisor_at_most(n: int, target: int) -> int:
    """The released ``_get_smaller_split``: the largest divisor of n that is <= target, or n
    when n <= target."""
    if n <= target:
        return n
    best = 1
    for d in range(1, target + 1):
        if n % d == 0:
            best = d
    return best


def tiles_of(shape, tile, chunk):
    """(m, n) of the matrix view and (h, w) of its tiles."""
    size = math.prod(shape)
    if len(shape) <= 1:
        return (1, size), (1, divisor_at_most(size, chunk))
    m, n = shape[0], size // shape[0]
    return (m, n), (divisor_at_most(m, tile[0]), divisor_at_most(n, tile[1]))


def kept_per_chunk(k: int, size: int) -> int:
    """The released ``_clamp_topk`` (min(k, size), at least 2, even), at most ``size``."""
    kk = max(min(k, size), 2)
    return min(kk - kk % 2, size)


def to_chunks(x, tile, chunk):
    """The tensor's tiles, row-major, each flattened row-major: a list of vectors."""
    (m, n), (h, w) = tiles_of(x.shape, tile, chunk)
    mat = np.asarray(x).reshape(m, n)
    return [
        mat[y * h : (y + 1) * h, c * w : (c + 1) * w].reshape(-1)
        for y in range(m // h)
        for c in range(n // w)
    ]


def from_chunks(chunks, shape, tile, chunk):
    (m, n), (h, w) = tiles_of(shape, tile, chunk)
    mat = np.zeros((m, n), chunks[0].dtype)
    i = 0
    for y in range(m // h):
        for c in range(n // w):
            mat[y * h : (y + 1) * h, c * w : (c + 1) * w] = chunks[i].reshape(h, w)
            i += 1
    return mat.reshape(shape)


def quantize(v, bins=4, range_sigmas=6):
    """The released ``_quantize_values`` on a flat vector, in ``v``'s float dtype:
    ``(codes, shift, scale, lookup)``."""
    v = np.asarray(v)
    one = v.dtype.type
    shift = v.mean(dtype=v.dtype)
    centered = v - shift
    with np.errstate(divide="ignore", invalid="ignore"):
        std = np.sqrt(np.sum(centered * centered)) / one(math.sqrt(v.size - 1))
    scale = one(range_sigmas) * std / one(bins)
    if scale == 0 or not np.isfinite(scale):
        scale = one(1.0)
    codes = np.clip(np.round(centered / scale + bins // 2), 0, bins - 1).astype(np.uint8)
    lookup = np.zeros(bins, v.dtype)
    for b in range(bins):
        members = centered[codes == b]
        if members.size:
            lookup[b] = members.sum() / one(members.size)
    return codes, shift, scale, lookup


def dequantize(codes, shift, lookup):
    return lookup[codes.astype(np.int64)] + shift


def compress(x, k, tile=(64, 64), chunk=4096, bins=4):
    """One tensor: per chunk the indices of its top k (ties: lower index first), then the
    quantizer over all the kept values. Returns ``(indices, codes, shift, scale, lookup)``,
    indices and codes as lists over the chunks."""
    chunks = to_chunks(x, tile, chunk)
    kk = kept_per_chunk(k, chunks[0].size)
    idx = [np.argsort(-np.abs(c), kind="stable")[:kk] for c in chunks]
    vals = np.concatenate([c[i] for c, i in zip(chunks, idx, strict=True)])
    codes, shift, scale, lookup = quantize(vals, bins)
    return idx, codes.reshape(len(chunks), kk), shift, scale, lookup


def sent_values(encoded):
    """The decoded kept values of one tensor, a list over its chunks."""
    _, codes, shift, _, lookup = encoded
    return [dequantize(c, shift, lookup) for c in codes]


def decompress(encoded, shape, tile=(64, 64), chunk=4096):
    idx = encoded[0]
    vals = sent_values(encoded)
    (_, _), (h, w) = tiles_of(shape, tile, chunk)
    dense = []
    for i, v in zip(idx, vals, strict=True):
        out = np.zeros(h * w, v.dtype)
        out[i] = v
        dense.append(out)
    return from_chunks(dense, shape, tile, chunk)


def clip_factors(norms):
    """min(median / (norm + 1e-8), 1) per replica, median the lower middle value; all 1 for
    a single replica (co2jax's stated deviation: a factor of 1 - O(1e-8) there)."""
    if len(norms) == 1:
        return [1.0]
    median = sorted(norms)[(len(norms) - 1) // 2]
    return [min(median / (n + 1e-8), 1.0) for n in norms]


def aggregate(encodings, shape, tile=(64, 64), chunk=4096, average="contributors", clip=True):
    """One tensor's aggregate of the replicas' encodings: clipped, then summed per index and
    divided by its contributors (or by R)."""
    vals = [sent_values(e) for e in encodings]
    norms = [math.sqrt(sum(float(np.sum(c * c)) for c in v)) for v in vals]
    factors = clip_factors(norms) if clip else [1.0] * len(vals)
    (_, _), (h, w) = tiles_of(shape, tile, chunk)
    chunks = len(vals[0])
    total = [np.zeros(h * w) for _ in range(chunks)]
    count = [np.zeros(h * w) for _ in range(chunks)]
    for e, v, f in zip(encodings, vals, factors, strict=True):
        for ch in range(chunks):
            total[ch][e[0][ch]] += f * v[ch]
            count[ch][e[0][ch]] += 1
    if average == "contributors":
        out = [t / np.maximum(c, 1.0) for t, c in zip(total, count, strict=True)]
    else:
        out = [t / len(encodings) for t in total]
    return from_chunks(out, shape, tile, chunk)


def sparseloco_production(
    problem: Problem,
    lr: float,
    H: int,
    rounds: int,
    alpha: float = 1.0,
    beta: float = 0.95,
    k: int = 64,
    tile=(64, 64),
    chunk: int = 4096,
    average: str = "contributors",
    clip: bool = True,
    shapes=None,
) -> np.ndarray:
    """e_r <- beta e_r + Delta_r; per tensor send_r = Q(TopK(e_r)); e_r -= decode(send_r);
    theta <- theta - alpha * aggregate(send). ``shapes``: the tensors theta is cut into
    (default: the shared tests' two leaves, 2 elements then the rest). ``[rounds, R, dim]``."""
    R, dim = problem.replicas, problem.d.shape[1]
    shapes = ((2,), (dim - 2,)) if shapes is None else shapes
    anchor, out = problem.theta0.copy(), []
    e = [np.zeros(dim) for _ in range(R)]
    for _ in range(rounds):
        sent = []
        for r in range(R):
            e[r] = beta * e[r] + (anchor - inner_sgd(problem, r, anchor, lr, H))
            leaves = split_leaves(e[r], shapes)
            encodings = [compress(x, k, tile, chunk) for x in leaves]
            decoded = [
                decompress(enc, s, tile, chunk).reshape(-1)
                for enc, s in zip(encodings, shapes, strict=True)
            ]
            e[r] = e[r] - np.concatenate(decoded)
            sent.append(encodings)
        step = [
            aggregate([sent[r][i] for r in range(R)], s, tile, chunk, average, clip).reshape(-1)
            for i, s in enumerate(shapes)
        ]
        anchor = anchor - alpha * np.concatenate(step)
        out.append(np.stack([anchor] * R))
    return np.array(out)
