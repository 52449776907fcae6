"""Numpy textbook loop of error feedback through the two-step compressed all-reduce
(docs/compression.md; MuLoCo's default, docs/algorithms/muloco.md): the block codecs in
float32, the collective's shards of whole blocks, DiLoCo's outer step. Nothing here imports
co2jax."""

from __future__ import annotations

import ml_dtypes
import numpy as np

_FP4_LEVELS = np.float32(2.0) ** np.arange(-6, 1, dtype=np.float32)  # code c in 1..7: 2**(c-7)
_LEVELS = {"int8": 127, "int4": 7, "fp8": 448}  # max|x| maps to these (fp4, 2bit: to 1)


def block_roundtrip(x, fmt, block):
    """``D(C(x))`` of a block codec of co2jax.comm (``int8``, ``int4``, ``fp8``, ``fp4``,
    ``2bit``) in float32: blocks of ``block`` consecutive elements from ``x``'s first (the
    last zero-padded), one float32 scale each: ``max|x|`` over 127, 7, 448, or itself (times
    the float32 reciprocal, as XLA divides by a constant: the codec's scales bit for bit)."""
    n = x.size
    xb = np.pad(np.asarray(x, np.float32), (0, (-n) % block)).reshape(-1, block)
    top = np.abs(xb).max(axis=1, keepdims=True)
    s = top * np.float32(1.0 / _LEVELS[fmt]) if fmt in _LEVELS else top
    y = xb / np.where(s > 0, s, np.float32(1))
    if fmt in ("int8", "int4"):  # round half to even, symmetric codes
        q = np.clip(np.round(y), -_LEVELS[fmt], _LEVELS[fmt])
    elif fmt == "fp8":
        q = y.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    elif fmt == "fp4":  # the nearest level in the linear domain (ties up), below half the least 0
        mids = np.concatenate([_FP4_LEVELS[:1] / 2, (_FP4_LEVELS[1:] + _FP4_LEVELS[:-1]) / 2])
        code = (np.abs(y)[..., None] >= mids).sum(axis=-1)
        q = np.sign(y) * np.where(code > 0, _FP4_LEVELS[np.maximum(code - 1, 0)], 0)
    elif fmt == "2bit":  # ternary
        q = np.where(y >= 0.5, 1.0, np.where(y <= -0.5, -1.0, 0.0))
    else:
        raise ValueError(f"fmt must be a block codec's name, got fmt={fmt!r}")
    return (q.astype(np.float32) * s).reshape(-1)[:n]


def two_step_shard(n, replicas, block):
    """Elements of each of the two-step collective's R shards of an n-vector: whole blocks."""
    blocks = -(-n // block)
    return block * -(-blocks // replicas)


def two_step_mean(sent, fmt, block):
    """The two-step compressed all-reduce of the replicas' vectors ``sent`` ([R, n]): shard i
    (``two_step_shard`` elements, whole blocks) of every replica decoded (``D(C(.))``) and
    averaged in float32 by replica i (summed in replica order), then quantized again; the
    shards concatenated."""
    sent = np.asarray(sent, np.float32)
    R, n = sent.shape
    m = two_step_shard(n, R, block)
    shards = np.pad(sent, ((0, 0), (0, R * m - n))).reshape(R, R, m)
    out = []
    for i in range(R):
        total = np.zeros(m, np.float32)
        for r in range(R):
            total = total + block_roundtrip(shards[r, i], fmt, block)
        out.append(block_roundtrip(total * np.float32(1.0 / R), fmt, block))
    return np.concatenate(out)[:n]


def diloco_feedback_two_step(
    local,
    theta0,
    rounds,
    replicas,
    eta,
    mu,
    decay,
    scale,
    fmt,
    block,
    delay=0,
    segments=None,
    dtype=np.float64,
):
    """DiLoCo with error feedback through the two-step compressed all-reduce, per replica
    ``t = scale * Delta_r + decay * e_r``, ``c_r = D(C(t))``, ``e_r <- t - c_r``, then
    ``g = two_step_mean(c)`` (c quantized again, blocks of the same layout: the mean's second
    quantization) applied ``delay`` rounds later by Nesterov(eta, mu) (mu = 0: SGD).

    ``local(t, anchor)``: the R replicas' parameters at the end of round t. ``segments``:
    consecutive lengths of ``theta0`` that are encoded on their own (the groups of leaves that
    vary over different mesh axes; default one). ``dtype=np.float32`` runs every step in
    float32, as the algorithm does (float64 roundings land across an int8 quantization
    threshold in about 1e-5 of the elements, and change a code there). Returns the anchors
    ``[rounds, dim]`` and the residuals after each round's send ``[rounds, R, dim]``."""
    f = np.dtype(dtype).type
    eta, mu, decay, scale = f(eta), f(mu), f(decay), f(scale)
    cuts = np.cumsum(segments or [theta0.size])[:-1]
    per = lambda g, x: np.concatenate([g(np.asarray(p)) for p in np.split(x, cuts, axis=-1)], -1)
    anchor, b, history, anchors, residuals = np.asarray(theta0, dtype), f(0), [], [], []
    e = np.zeros((replicas, anchor.size), dtype)
    for t in range(rounds):
        sent = []
        for r, x in enumerate(local(t, anchor)):
            target = scale * (anchor - x) + decay * e[r]
            c = per(lambda v: block_roundtrip(v, fmt, block), target).astype(dtype)
            e[r] = target - c
            sent.append(c)
        residuals.append(e.copy())
        history.append(per(lambda v: two_step_mean(v, fmt, block), np.stack(sent)))
        if t >= delay:  # optax's Nesterov: b <- g + mu b, step -eta (g + mu b)
            g = history[t - delay].astype(dtype)
            b = g + mu * b
            anchor = anchor + -eta * (g + mu * b)
        anchors.append(anchor)
    return np.array(anchors), np.array(residuals)
