"""The fused outer update in plain jnp: the obviously-correct twin of the Pallas kernel.

Element-wise on arrays of any shape, so it serves as the ``"xla"`` implementation on whole
leaves and as the kernel's reference on buckets. The math is :class:`OuterUpdateSpec`'s.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from co2jax.kernels.spec import OuterUpdateSpec


class OuterUpdateOut(NamedTuple):
    """The outputs of one fused outer update (``None`` where the spec has no such buffer).

    Attributes:
      anchor: the new anchor, which is also every replica's next-round parameters.
      momentum: the new momentum (``spec.momentum is not None``).
      pending: ``anchor - params`` before the update (``spec.delayed``).
      gap_scale: the gap-aware magnitude average (``spec.penalty == "gap_aware"``).
      penalty_sum: 0-d float32, the sum of the multiplier ``lam`` over the elements.
    """

    anchor: jax.Array
    momentum: jax.Array | None
    pending: jax.Array | None
    gap_scale: jax.Array | None
    penalty_sum: jax.Array


def mean_payload(payloads: jax.Array) -> jax.Array:
    """The float32 mean over the leading (replica) axis."""
    return jnp.mean(payloads.astype(jnp.float32), axis=0)


def multiplier(spec: OuterUpdateSpec, anchor, momentum, gap_scale, gap_correction):
    """The penalty multiplier ``lam`` (float32, shaped like ``anchor``) and the new average."""
    f32 = jnp.float32
    if spec.penalty == "none":
        return jnp.ones(anchor.shape, f32), None
    if spec.penalty == "constant":
        return jnp.full(anchor.shape, spec.penalty_scale, f32), None
    previous = (anchor + spec.learning_rate * momentum).astype(anchor.dtype)
    gap = jnp.abs(anchor.astype(f32) - previous.astype(f32))
    c = gap_scale.astype(f32)
    c_hat = jnp.where(gap_correction > 0, c / jnp.where(gap_correction > 0, gap_correction, 1), 0)
    known = c_hat > spec.gap_eps
    lam = jnp.where(known, 1.0 / (1.0 + gap / jnp.where(known, c_hat, 1.0)), 1.0)
    return lam, spec.gap_decay * c + (1.0 - spec.gap_decay) * gap


def outer_update_reference(
    spec: OuterUpdateSpec,
    payloads: jax.Array,
    anchor: jax.Array,
    momentum: jax.Array | None = None,
    params: jax.Array | None = None,
    old_pending: jax.Array | None = None,
    gap_scale: jax.Array | None = None,
    *,
    apply: jax.Array | bool = True,
    gap_correction: jax.Array | float = 1.0,
) -> OuterUpdateOut:
    """One outer step (see :class:`OuterUpdateSpec`), written as the math reads.

    Args:
      spec: what to compute.
      payloads: ``[R, *anchor.shape]``: the R gathered payloads (R = 1: an already reduced
        pseudo-gradient), float32 or bfloat16.
      anchor: the current anchor (its dtype is the parameters' dtype).
      momentum: the momentum buffer (needed when ``spec.momentum is not None``).
      params: the replica's local parameters after its inner steps (``spec.delayed``).
      old_pending: the replica's own payload being averaged (``spec.eager_replicas``).
      gap_scale: the gap-aware average (``spec.penalty == "gap_aware"``).
      apply: 0-d bool; False keeps anchor, momentum and gap average (pending still written).
      gap_correction: the gap average's bias correction ``1 - gap_decay**n``.

    Example:
      >>> import jax.numpy as jnp
      >>> spec = OuterUpdateSpec(learning_rate=0.5, momentum=0.9, nesterov=True)
      >>> out = outer_update_reference(
      ...     spec, jnp.array([[1.0], [3.0]]), jnp.zeros(1), jnp.zeros(1))
      >>> out.anchor, out.momentum  # g = 2; m = 2; anchor = -0.5 * (2 + 0.9 * 2)
      (Array([-1.9], dtype=float32), Array([2.], dtype=float32))
    """
    f32 = jnp.float32
    a = anchor.astype(f32)
    g = mean_payload(payloads)
    pending = None
    if spec.delayed:
        pending = (anchor - params).astype(anchor.dtype)
        if spec.eager_replicas:
            g = g + (pending.astype(f32) - old_pending.astype(f32)) / spec.eager_replicas
    lam, new_gap = multiplier(spec, anchor, momentum, gap_scale, gap_correction)
    g = lam * g
    new_momentum = None
    if spec.momentum is None:
        u = g
    else:
        m = (spec.momentum * momentum.astype(f32) + g).astype(momentum.dtype)
        if spec.clip is not None:
            m = jnp.clip(m, -spec.clip, spec.clip)
        new_momentum = m
        u = g + spec.momentum * m.astype(f32) if spec.nesterov else m.astype(f32)
    new_anchor = (a - spec.learning_rate * u).astype(anchor.dtype)
    apply = jnp.asarray(apply)
    new_anchor = jnp.where(apply, new_anchor, anchor)
    if new_momentum is not None:
        new_momentum = jnp.where(apply, new_momentum, momentum)
    if new_gap is not None:
        new_gap = jnp.where(apply, new_gap, gap_scale).astype(gap_scale.dtype)
    return OuterUpdateOut(new_anchor, new_momentum, pending, new_gap, jnp.sum(lam))
