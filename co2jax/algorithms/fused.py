"""Outer transforms the fused kernel can run: their math as an ``OuterUpdateSpec``.

An optax transform is opaque, so :func:`~co2jax.pseudo_gradient_method` can only hand the
whole outer step (the replicas' mean, the pending payload, the eager correction, the
penalty, the momentum, the clip and the anchor update) to
:func:`co2jax.kernels.outer_update` when the transform says what it computes. A transform
that does carries a :class:`Fusable` next to its ``init`` and ``update``
(:class:`FusableTransformation`); it stays an ordinary optax transform everywhere else.

- :func:`outer_sgd`: ``optax.sgd`` (plain, heavy-ball or Nesterov), with optax's own state;
- CO2's :func:`~co2jax.algorithms.co2.scale_by_co2_momentum` with no penalty, a constant or
  the gap-aware penalty.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import optax

from co2jax._checks import check_positive, check_unit_interval
from co2jax.kernels.spec import OuterUpdateSpec


@dataclasses.dataclass(frozen=True)
class Fusable:
    """How a transform's state maps onto the fused update's buffers.

    Attributes:
      spec: the transform's math (``delayed`` and ``eager_replicas`` are filled in by the
        pseudo-gradient method).
      split: ``outer_state -> (momentum, gap_scale, gap_count)``; ``None`` where absent.
      merge: ``(outer_state, momentum, gap_scale, penalty_mean, applied) -> outer_state``.
    """

    spec: OuterUpdateSpec
    split: Callable[[Any], tuple[Any, Any, Any]]
    merge: Callable[[Any, Any, Any, Any, Any], Any]


class FusableTransformation(NamedTuple):
    """An optax ``GradientTransformation`` that also describes itself to the fused kernel."""

    init: Callable
    update: Callable
    fusable: Fusable


def fusable_of(transform: Any) -> Fusable | None:
    return getattr(transform, "fusable", None)


def outer_sgd(
    learning_rate: float, momentum: float | None = None, nesterov: bool = False
) -> FusableTransformation:
    """``optax.sgd(learning_rate, momentum, nesterov)``, runnable by the fused kernel.

    Same state and same numbers as optax's (``b <- mu*b + g``; update ``-eta*(g + mu*b)``
    with Nesterov, ``-eta*b`` without); the learning rate is a constant (a schedule cannot
    be fused; use ``optax.sgd`` for one).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> tx = outer_sgd(0.7, momentum=0.9, nesterov=True)
      >>> state = tx.init(jnp.zeros(1))
      >>> tx.update(jnp.ones(1), state)[0]  # -0.7 * (1 + 0.9 * 1)
      Array([-1.33], dtype=float32)
    """
    learning_rate = check_positive("learning_rate", learning_rate)
    if momentum is not None:
        momentum = check_unit_interval("momentum", momentum)
    if nesterov and momentum is None:
        raise ValueError("nesterov=True needs a momentum, got momentum=None")
    base = optax.sgd(learning_rate, momentum=momentum, nesterov=nesterov)
    spec = OuterUpdateSpec(learning_rate, momentum, nesterov=bool(nesterov))

    def split(state):
        return (_trace(state).trace if momentum is not None else None), None, None

    def merge(state, m, gap, penalty_mean, applied):
        del gap, penalty_mean, applied
        if momentum is None:
            return state
        return _with_trace(state, _trace(state)._replace(trace=m))

    return FusableTransformation(base.init, base.update, Fusable(spec, split, merge))


def _trace(state: Any) -> optax.TraceState | None:
    """The ``optax.TraceState`` inside an optax state (found by type, at any depth)."""
    if isinstance(state, optax.TraceState):
        return state
    for part in state if isinstance(state, tuple) else ():
        found = _trace(part)
        if found is not None:
            return found
    return None


def _with_trace(state: Any, trace: optax.TraceState) -> Any:
    """``state`` with its ``optax.TraceState`` replaced by ``trace``."""
    if isinstance(state, optax.TraceState):
        return trace
    if not isinstance(state, tuple):
        return state
    parts = [_with_trace(part, trace) for part in state]
    return type(state)(*parts) if hasattr(type(state), "_fields") else type(state)(parts)
