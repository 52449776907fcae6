"""DiLoCo and its delayed variants: naive delay and eager updates."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import optax

from co2jax._checks import check_int
from co2jax.algorithms.outer_schedules import outer_transform
from co2jax.algorithms.pseudo_gradient import pseudo_gradient_method
from co2jax.algorithms.registry import register
from co2jax.algorithms.settings import (
    Compression,
    Delay,
    Fused,
    Guard,
    OuterStep,
    Settings,
    setting,
)
from co2jax.axes import REPLICA
from co2jax.comm.reducer import Reducer
from co2jax.protocol import OuterOptimizer


def diloco(
    outer_optimizer: optax.GradientTransformation,
    *,
    axis_name: str = REPLICA,
    reduce: Reducer | None = None,
    implementation: str = "auto",
) -> OuterOptimizer:
    """DiLoCo: an optax outer optimizer applied to the averaged pseudo-gradient.

    .. math::

        \\bar\\Delta^{(t)} = \\operatorname{mean}_r (\\theta^{(t)} - \\theta_r^{(t,H)}), \\qquad
        \\theta^{(t+1)} = \\theta^{(t)} + \\mathrm{OuterOpt}(\\bar\\Delta^{(t)})

    The paper's outer optimizer is ``optax.sgd(0.7, momentum=0.9, nesterov=True)``:
    ``b <- mu*b + D; theta <- theta - eta*(D + mu*b)``; ``co2jax.outer_sgd(0.7, 0.9,
    nesterov=True)`` is the same transform, runnable by the fused outer-update kernel. The
    inner optimizer (AdamW, lr 4e-4, weight decay 0.1, betas (0.9, 0.95)) belongs to the
    training loop and keeps its state across syncs.

    Args:
      outer_optimizer: any optax transform; it sees the averaged pseudo-gradient as its
        gradient, so a descent step moves the anchor toward the replicas.
      axis_name: the replica axis.
      reduce: the cross-replica reduction (default: mean over ``axis_name``).
      implementation: the fused outer update's (``"auto"``, ``"pallas"``, ``"interpret"``,
        ``"xla"``), used when ``outer_optimizer`` is fusable (:func:`co2jax.outer_sgd`).

    Example:
      >>> import jax, jax.numpy as jnp, optax, co2jax
      >>> outer = co2jax.diloco(optax.sgd(0.7, momentum=0.9, nesterov=True))
      >>> state = jax.vmap(outer.init)(jnp.zeros((2, 1)))
      >>> params, state = jax.jit(jax.vmap(outer.sync, axis_name="replica"))(
      ...     jnp.array([[1.0], [3.0]]), state)
      >>> params  # 0 - 0.7 * (-2 + 0.9 * -2)
      Array([[2.66],
             [2.66]], dtype=float32)

    References:
      Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
      Models", arXiv 2311.08105.
    """
    return pseudo_gradient_method(
        outer_optimizer, axis_name=axis_name, reduce=reduce, implementation=implementation
    )


def delayed_diloco(
    outer_optimizer: optax.GradientTransformation,
    delay: int = 1,
    *,
    axis_name: str = REPLICA,
    reduce: Reducer | None = None,
    implementation: str = "auto",
) -> OuterOptimizer:
    """Naive delayed DiLoCo: the average of round t's pseudo-gradients is applied at round t+d.

    .. math::

        \\theta^{(t+1)} = \\theta^{(t)} + \\mathrm{OuterOpt}(\\bar\\Delta^{(t-d)}), \\qquad
        \\bar\\Delta^{(s)} = 0 \\text{ for } s < 0

    The reduction of ``Delta_r^(t-d)`` needs nothing from round t, so it can run while round
    t's inner steps compute (it is sent before them). ``delay=0`` is :func:`diloco`.

    Args:
      outer_optimizer: any optax transform on the (delayed) averaged pseudo-gradient.
      delay: rounds between sending a pseudo-gradient and applying its average (>= 0).
      axis_name: the replica axis.
      reduce: the cross-replica reduction (default: mean over ``axis_name``).
      implementation: the fused outer update's (``"auto"``, ``"pallas"``, ``"interpret"``,
        ``"xla"``), used when ``outer_optimizer`` is fusable (:func:`co2jax.outer_sgd`).

    Example:
      >>> import jax, jax.numpy as jnp, optax, co2jax
      >>> outer = co2jax.delayed_diloco(optax.sgd(1.0), delay=1)
      >>> state = jax.vmap(outer.init)(jnp.zeros((2, 1)))
      >>> sync = jax.jit(jax.vmap(outer.sync, axis_name="replica"))
      >>> params, state = sync(jnp.array([[1.0], [3.0]]), state)
      >>> params  # the first average lands one round late
      Array([[0.],
             [0.]], dtype=float32)
      >>> params, state = sync(params, state)
      >>> params
      Array([[2.],
             [2.]], dtype=float32)

    References:
      Kale, Douillard, Donchev, "Eager Updates For Overlapped Communication and Computation
      in DiLoCo", arXiv 2502.12996.
    """
    return pseudo_gradient_method(
        outer_optimizer,
        delay=check_int("delay", delay, 0),
        axis_name=axis_name,
        reduce=reduce,
        implementation=implementation,
    )


def eager_diloco(
    outer_optimizer: optax.GradientTransformation,
    delay: int = 1,
    *,
    num_replicas: int | None = None,
    axis_name: str = REPLICA,
    reduce: Reducer | None = None,
    implementation: str = "auto",
) -> OuterOptimizer:
    """Eager updates: the replica's own fresh pseudo-gradient stands in for its share.

    While the average of round t's pseudo-gradients is still on the wire, replica r knows its
    own ``Delta_r^(t)`` and the true average of round t-d. It replaces, in that average, its
    own stale contribution by its fresh one:

    .. math::

        \\hat\\Delta_r^{(t)} = \\bar\\Delta^{(t-d)}
                             + \\frac{\\Delta_r^{(t)} - \\Delta_r^{(t-d)}}{R}, \\qquad
        \\theta_r^{(t+1)} = \\theta_r^{(t)} + \\mathrm{OuterOpt}_r(\\hat\\Delta_r^{(t)})

    with ``Delta^(s) = 0`` for s < 0 (so round 0 applies ``Delta_r^(0) / R``). The anchor and
    the outer optimizer's state are replica-local. Summed over rounds, every true average is
    applied exactly once and each replica's own last ``d`` pseudo-gradients are applied
    eagerly (the sum telescopes), so with a linear outer optimizer the replicas' anchors
    differ by a bounded amount and never drift apart.

    Indexing (unverified against the paper's Algorithm 3): for ``d = 1`` we follow
    ``Delta-hat_r^(t) = Delta-bar^(t-1) + (Delta_r^(t) - Delta_r^(t-1)) / R``
    (docs/algorithms/eager_diloco.md); ``d >= 2`` (the paper's "2-outer-steps eager")
    generalises it by the same telescoping.

    Args:
      outer_optimizer: any optax transform applied to ``Delta-hat_r``.
      delay: rounds before the true average arrives (>= 1).
      num_replicas: R; ``None`` reads the size of ``axis_name``.
      axis_name: the replica axis.
      reduce: the cross-replica reduction (default: mean over ``axis_name``).
      implementation: the fused outer update's (``"auto"``, ``"pallas"``, ``"interpret"``,
        ``"xla"``), used when ``outer_optimizer`` is fusable (:func:`co2jax.outer_sgd`).

    Example:
      >>> import jax, jax.numpy as jnp, optax, co2jax
      >>> outer = co2jax.eager_diloco(optax.sgd(1.0))
      >>> state = jax.vmap(outer.init)(jnp.zeros((2, 1)))
      >>> params, state = jax.jit(jax.vmap(outer.sync, axis_name="replica"))(
      ...     jnp.array([[1.0], [3.0]]), state)
      >>> params  # each replica applies its own Delta_r / R eagerly
      Array([[0.5],
             [1.5]], dtype=float32)

    References:
      Kale, Douillard, Donchev, "Eager Updates For Overlapped Communication and Computation
      in DiLoCo", arXiv 2502.12996.
    """
    return pseudo_gradient_method(
        outer_optimizer,
        delay=check_int("delay", delay, 1),
        eager=True,
        num_replicas=num_replicas,
        axis_name=axis_name,
        reduce=reduce,
        implementation=implementation,
    )


def _identity(axis_name: str) -> Reducer:
    """One replica: its payload is the mean (nothing crosses any axis)."""
    del axis_name
    return Reducer("identity", lambda payload: payload, lambda shapes, r: 0.0)


def snoo(
    learning_rate: float | Callable = 0.7,
    momentum: float | Callable = 0.9,
    *,
    axis_name: str = REPLICA,
) -> OuterOptimizer:
    """SNOO: Nesterov momentum on the pseudo-gradient of a single worker (DiLoCo, M = 1).

    Every ``sync_every`` inner steps (the driver's H, "step K" in the paper):
    ``Delta = anchor - theta; b <- mu*b + Delta; anchor <- anchor - eta*(Delta + mu*b);
    theta <- anchor``. No replica axis is needed: the reduction is the identity, so it runs
    in a plain single-device optax loop through :func:`co2jax.local_updates`.
    ``learning_rate`` and ``momentum`` may be schedules of the outer step.

    Example:
      >>> import jax.numpy as jnp, optax, co2jax
      >>> tx = co2jax.local_updates(optax.sgd(0.5), co2jax.snoo(1.0, 0.0), sync_every=2)
      >>> params = jnp.array([4.0]); state = tx.init(params)
      >>> for _ in range(2):  # loss 0.5 * theta**2: theta 4 -> 2 -> 1, then the sync
      ...     updates, state = tx.update(params, state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> params  # eta 1, mu 0: the anchor moves all the way to theta
      Array([1.], dtype=float32)

    References:
      Kallusky et al., "SNOO: Step-K Nesterov Outer Optimizer", arXiv 2510.15830.
    """
    outer = outer_transform("sgd", learning_rate, momentum, nesterov=True)
    return diloco(outer, axis_name=axis_name, reduce=_identity(axis_name))


@register("outer Nesterov on pseudo-gradients")
@dataclasses.dataclass(frozen=True)
class DiLoCoSettings(Settings, OuterStep, Compression, Fused, Guard):
    """DiLoCo's settings: the outer transform, compression, the fused update, the guard."""

    algorithm: str = setting("diloco", "the algorithm")

    def build(self, context, reduce) -> OuterOptimizer:
        return diloco(self.transform(context), reduce=reduce, implementation=self.implementation)


@register("naive one-round delay")
@dataclasses.dataclass(frozen=True)
class DelayedDiLoCoSettings(Settings, OuterStep, Delay, Compression, Fused, Guard):
    """Delayed DiLoCo's settings: DiLoCo's and the delay."""

    algorithm: str = setting("delayed_diloco", "the algorithm")

    def build(self, context, reduce) -> OuterOptimizer:
        return delayed_diloco(
            self.transform(context), self.delay, reduce=reduce, implementation=self.implementation
        )


@register("eager updates")
@dataclasses.dataclass(frozen=True)
class EagerDiLoCoSettings(Settings, OuterStep, Delay, Fused):
    """Eager DiLoCo's settings: the outer transform, the delay, the fused update (replica-
    local anchors: no guard, no compression)."""

    algorithm: str = setting("eager_diloco", "the algorithm")

    def build(self, context, reduce) -> OuterOptimizer:
        return eager_diloco(
            self.transform(context),
            self.delay,
            num_replicas=context.num_replicas,
            reduce=reduce,
            implementation=self.implementation,
        )
