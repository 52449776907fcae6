"""MuLoCo: Muon as the inner optimizer of DiLoCo, with error-feedback compressed pseudo-gradients.

The inner side is :func:`muon` on the hidden weight matrices (MuLoCo's released Muon: a
momentum sum, five Newton-Schulz steps with per-step coefficients, a shape scale) and the
run's own transform (AdamW) on everything else (embeddings, the output head, vectors). The
outer side is DiLoCo's Nesterov step on the mean of error-feedback compressed
pseudo-gradients whose feedback carries the outer learning rate, as released.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from co2jax._checks import check_choice, check_unit_interval
from co2jax.algorithms.diloco import diloco
from co2jax.algorithms.error_feedback import error_feedback
from co2jax.algorithms.registry import register
from co2jax.algorithms.settings import (
    COLLECTIVES,
    COMPRESSIONS,
    Compression,
    Fused,
    Guard,
    OuterStep,
    Settings,
    fail,
    setting,
)
from co2jax.protocol import OuterOptimizer

COEFFICIENTS = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)
"""The Newton-Schulz coefficients (a, b, c) of MuLoCo's released Muon, one per step."""
SCALES = ("spectral", "rms")
NOT_HIDDEN = ("embed", "head", "output", "unembed")


class MuonState(NamedTuple):
    """State of :func:`muon`: ``momentum``, the sum ``M <- mu M + G`` per matrix (float32,
    replica-varying)."""

    momentum: optax.Updates


def _matrix(x: jax.Array) -> jax.Array:
    """``x`` as a matrix: a vector stays 1 x n, more than two axes fold into the rows."""
    return x.reshape(x.shape[0], -1) if x.ndim >= 2 else x.reshape(1, -1)


def newton_schulz(u: jax.Array, coefficients=COEFFICIENTS, eps: float = 1e-7) -> jax.Array:
    """The orthogonalised ``u`` (2-D): ``X = U / (||U||_F + eps)`` (transposed when it has
    more rows than columns), then per step ``X <- a X + (b A + c A^2) X`` with
    ``A = X X^T``, in float32."""
    x = u.astype(jnp.float32)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (jnp.linalg.norm(x) + eps)
    for a, b, c in coefficients:
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def muon(
    momentum: float = 0.9,
    *,
    nesterov: bool = False,
    scale: str = "spectral",
    coefficients=COEFFICIENTS,
    eps: float = 1e-7,
) -> optax.GradientTransformation:
    """Muon's direction for weight matrices, as MuLoCo releases it (no learning rate: chain
    ``optax.add_decayed_weights`` and ``optax.scale_by_learning_rate`` after it).

    Per matrix ``W`` of shape ``(fan_in, fan_out)`` (flax's kernel layout; more axes fold
    into the rows):

    .. math::

        M \\leftarrow \\mu M + G, \\quad U = M \\ (\\text{or } \\mu M + G \\text{ with
        Nesterov}), \\quad O = \\mathrm{NS}(U), \\quad
        \\text{update} = s \\cdot O,

    ``s = sqrt(fan_out / fan_in)`` (``"spectral"``, the released default) or
    ``0.2 sqrt(max(fan_in, fan_out))`` (``"rms"``). ``NS`` is :func:`newton_schulz` with
    the five per-step coefficients of :data:`COEFFICIENTS`. The released code runs NS in
    bfloat16; this runs it in float32.

    Args:
      momentum: mu in [0, 1).
      nesterov: U = mu M + G instead of M.
      scale: ``"spectral"`` or ``"rms"``.
      coefficients: (a, b, c) per Newton-Schulz step.
      eps: added to the Frobenius norm.

    Example:
      >>> import jax.numpy as jnp, optax, co2jax
      >>> tx = co2jax.muon()
      >>> g = jnp.array([[3.0, 0.0], [0.0, 1.0]])
      >>> u, _ = tx.update(g, tx.init(g))
      >>> u.round(1)  # close to the orthogonal factor of g: the identity
      Array([[1., 0.],
             [0., 1.]], dtype=float32)
    """
    mu = check_unit_interval("momentum", momentum)
    scale = check_choice("scale", scale, SCALES)
    coefficients = tuple(tuple(float(v) for v in abc) for abc in coefficients)

    def factor(shape) -> float:
        rows, cols = _matrix(jnp.zeros(shape, jnp.int8)).shape
        if scale == "spectral":
            return math.sqrt(cols / rows)
        return 0.2 * math.sqrt(max(rows, cols))

    def init(params) -> MuonState:
        return MuonState(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))

    def update(updates, state: MuonState, params=None):
        del params
        m = jax.tree.map(lambda m, g: mu * m + g.astype(jnp.float32), state.momentum, updates)
        u = jax.tree.map(lambda m, g: mu * m + g.astype(jnp.float32), m, updates) if nesterov else m

        def direction(u, g):
            o = newton_schulz(_matrix(u), coefficients, eps).reshape(g.shape)
            return (factor(g.shape) * o).astype(g.dtype)

        return jax.tree.map(direction, u, updates), MuonState(m)

    return optax.GradientTransformation(init, update)


def hidden_matrix(path: tuple, leaf: Any) -> bool:
    """Whether a parameter is a hidden weight matrix (Muon's): two or more axes and no
    ``embed``, ``head``, ``output`` or ``unembed`` in its path (MuLoCo's classification:
    embeddings, the output head and vectors take AdamW)."""
    names = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path).lower()
    return jnp.ndim(leaf) >= 2 and not any(n in names for n in NOT_HIDDEN)


def muloco_inner(
    transform: optax.GradientTransformation,
    learning_rate: optax.ScalarOrSchedule,
    *,
    momentum: float = 0.9,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    scale: str = "spectral",
    hidden=hidden_matrix,
) -> optax.GradientTransformation:
    """MuLoCo's inner optimizer: :func:`muon` with decoupled weight decay at
    ``learning_rate`` on the hidden matrices (``hidden(path, leaf)``), ``transform`` (the
    run's AdamW) on the rest. ``W <- W (1 - lr wd) - lr s NS(U)``.

    Example:
      >>> import jax.numpy as jnp, optax, co2jax
      >>> tx = co2jax.muloco_inner(optax.sgd(1.0), 0.5)   # SGD on the rest, to read it
      >>> params = {"embed": jnp.ones((4, 2)), "w": 3 * jnp.eye(2), "b": jnp.ones(2)}
      >>> updates, _ = tx.update(params, tx.init(params), params)
      >>> updates["b"], updates["embed"][0]   # the gradient, by SGD
      (Array([-1., -1.], dtype=float32), Array([-1., -1.], dtype=float32))
      >>> updates["w"].round(2)               # Muon: -lr * NS(G), about -0.5 * I
      Array([[-0.51, -0.  ],
             [-0.  , -0.51]], dtype=float32)
    """
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got weight_decay={weight_decay!r}")
    matrices = optax.chain(
        muon(momentum, nesterov=nesterov, scale=scale),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    )
    labels = lambda params: jax.tree_util.tree_map_with_path(
        lambda path, leaf: "muon" if hidden(path, leaf) else "rest", params
    )
    return optax.partition({"muon": matrices, "rest": transform}, labels)


FEEDBACK_SCALES = ("outer_lr", "one")


@register("MuLoCo: Muon inside, DiLoCo outside on error-feedback 2-bit pseudo-gradients")
@dataclasses.dataclass(frozen=True)
class MuLoCoSettings(Settings, OuterStep, Compression, Fused, Guard):
    """MuLoCo's settings (arXiv 2505.23725; released defaults): DiLoCo's outer step at
    0.9 / 0.8, 2-bit pseudo-gradients quantized again after the reduction, error feedback
    with decay 0.9 carrying the outer learning rate, Muon on the hidden matrices."""

    algorithm: str = setting("muloco", "the algorithm")
    learning_rate: float = setting(0.9, "the outer learning rate")
    momentum: float = setting(0.8, "the outer momentum, in [0, 1)")
    compression: str = setting("2bit", "the payload's format on the wire", COMPRESSIONS)
    collective: str = setting(
        "two_step", "a compressed payload's collective (two_step: RS + AG)", COLLECTIVES
    )
    error_feedback: bool = setting(True, "keep what compression left out, per replica")
    error_decay: float = setting(0.9, "the residual's decay in error feedback, in [0, 1]")
    feedback_scale: str = setting(
        "outer_lr", "what the pseudo-gradient is scaled by in the feedback", FEEDBACK_SCALES
    )
    muon_momentum: float = setting(0.9, "Muon's momentum, in [0, 1)")
    muon_nesterov: bool = setting(False, "Muon's Nesterov momentum")
    muon_weight_decay: float = setting(0.0, "Muon's decoupled weight decay (x its lr)")
    muon_scale: str = setting("spectral", "Muon's shape scale: spectral or rms", SCALES)
    muon_lr_scale: float = setting(
        1.0, "Muon's learning rate as a multiple of the inner one (the release: 1, one lr)"
    )

    def check(self, bounds) -> None:
        if not 0 <= self.error_decay <= 1:
            fail("error_decay", self.error_decay, "must be in [0, 1]")
        if not 0 <= self.muon_momentum < 1:
            fail("muon_momentum", self.muon_momentum, "must be in [0, 1)")
        if self.muon_weight_decay < 0:
            fail("muon_weight_decay", self.muon_weight_decay, "must be >= 0")
        if not self.muon_lr_scale > 0:
            fail("muon_lr_scale", self.muon_lr_scale, "must be > 0")
        for name in ("error_decay", "feedback_scale"):
            self.unless(name, self.error_feedback, "outer.error_feedback is true")
        if self.feedback_scale == "outer_lr" and self.error_feedback:
            if self.lr_schedule != "constant" or self.lr_warmup:
                fail(
                    "feedback_scale",
                    self.feedback_scale,
                    "scales the feedback by a constant outer learning rate: needs "
                    "outer.lr_schedule='constant' and outer.lr_warmup=0 (or feedback_scale='one')",
                )

    def build(self, context, reduce) -> OuterOptimizer:
        return diloco(self.transform(context), reduce=reduce, implementation=self.implementation)

    def inner(self, transform, context):
        learning_rate = context.inner_learning_rate
        if learning_rate is None:
            raise ValueError("muloco needs the inner learning rate (Context.inner_learning_rate)")
        scale = self.muon_lr_scale
        muon_lr = (
            (lambda count: scale * learning_rate(count))
            if callable(learning_rate)
            else (scale * learning_rate)
        )
        return muloco_inner(
            transform,
            muon_lr,
            momentum=self.muon_momentum,
            nesterov=self.muon_nesterov,
            weight_decay=self.muon_weight_decay,
            scale=self.muon_scale,
        )

    def feedback(self, outer: OuterOptimizer) -> OuterOptimizer:
        scale = self.learning_rate if self.feedback_scale == "outer_lr" else 1.0
        return error_feedback(outer, self.error_decay, scale=scale)
