"""SlowMo: slow momentum on top of periodic averaging (Wang et al. 2020, arXiv 1910.00643)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from co2jax._checks import check_positive, check_unit_interval
from co2jax.algorithms.pseudo_gradient import pseudo_gradient_method
from co2jax.algorithms.registry import register
from co2jax.algorithms.settings import Guard, Settings, StepSize, setting
from co2jax.axes import REPLICA
from co2jax.comm.reducer import Reducer
from co2jax.protocol import OuterOptimizer


class SlowMomentumState(NamedTuple):
    """State of :func:`scale_by_slow_momentum` (replica-invariant).

    Attributes:
      momentum: the slow momentum buffer ``m``, shaped like the parameters.
      count: 0-d int32, the number of syncs so far (the round index fed to the schedule).
    """

    momentum: optax.Updates
    count: jax.Array


def scale_by_slow_momentum(
    inner_learning_rate: float | Callable[[jax.Array], jax.Array], slow_momentum: float
) -> optax.GradientTransformation:
    """SlowMo's momentum in units of the inner learning rate ``gamma_t`` of round t.

    ``m <- beta*m + g/gamma_t``; the update is ``gamma_t * m`` (chain with
    ``optax.scale(-alpha)`` for SlowMo's step).
    """
    schedule = (
        inner_learning_rate
        if callable(inner_learning_rate)
        else optax.constant_schedule(inner_learning_rate)
    )

    def init(params):
        return SlowMomentumState(jax.tree.map(jnp.zeros_like, params), jnp.zeros([], jnp.int32))

    def update(updates, state, params=None):
        del params
        gamma = schedule(state.count)
        momentum = jax.tree.map(
            lambda m, g: (slow_momentum * m + g / gamma).astype(m.dtype), state.momentum, updates
        )
        updates = jax.tree.map(lambda m: (gamma * m).astype(m.dtype), momentum)
        return updates, SlowMomentumState(momentum, state.count + 1)

    return optax.GradientTransformation(init, update)


def slowmo(
    inner_learning_rate: float | Callable[[jax.Array], jax.Array],
    slow_learning_rate: float = 1.0,
    slow_momentum: float = 0.5,
    *,
    axis_name: str = REPLICA,
    reduce: Reducer | None = None,
) -> OuterOptimizer:
    """SlowMo with exact averaging as the base algorithm.

    With inner learning rate ``gamma_t`` in round t:

    .. math::

        m \\leftarrow \\beta m + \\bar\\Delta^{(t)} / \\gamma_t, \\qquad
        \\theta^{(t+1)} = \\theta^{(t)} - \\alpha \\gamma_t m

    ``beta = 0, alpha = 1`` is Local SGD; with a constant ``gamma`` it equals DiLoCo with
    ``optax.sgd(alpha, momentum=beta)``. Its reference code uses ``beta`` 0.5-0.7, ``alpha``
    1.0.

    Args:
      inner_learning_rate: ``gamma``, a float > 0 or a schedule of the round index (0, 1, ...).
      slow_learning_rate: ``alpha`` (> 0).
      slow_momentum: ``beta`` in [0, 1).
      axis_name: the replica axis.
      reduce: the cross-replica reduction (default: mean over ``axis_name``).

    Returns:
      An :class:`~co2jax.OuterOptimizer` whose ``outer_state`` is a chain whose first element
      is a :class:`SlowMomentumState`.

    Example:
      >>> import jax, jax.numpy as jnp, co2jax
      >>> outer = co2jax.slowmo(inner_learning_rate=0.1, slow_momentum=0.5)
      >>> state = jax.vmap(outer.init)(jnp.zeros((2, 1)))
      >>> params, state = jax.jit(jax.vmap(outer.sync, axis_name="replica"))(
      ...     jnp.array([[1.0], [3.0]]), state)
      >>> params
      Array([[2.],
             [2.]], dtype=float32)

    References:
      Wang, Tantia, Ballas, Rabbat, "SlowMo: Improving Communication-Efficient Distributed
      SGD with Slow Momentum", arXiv 1910.00643.
    """
    if not callable(inner_learning_rate):
        check_positive("inner_learning_rate", inner_learning_rate)
    alpha = check_positive("slow_learning_rate", slow_learning_rate)
    beta = check_unit_interval("slow_momentum", slow_momentum)
    outer = optax.chain(scale_by_slow_momentum(inner_learning_rate, beta), optax.scale(-alpha))
    return pseudo_gradient_method(outer, axis_name=axis_name, reduce=reduce)


@register("slow momentum on periodic averaging")
@dataclasses.dataclass(frozen=True)
class SlowMoSettings(Settings, StepSize, Guard):
    """SlowMo's settings: the slow learning rate and momentum (the fast one is the inner
    schedule, ``Context.inner_learning_rate``)."""

    algorithm: str = setting("slowmo", "the algorithm")

    def build(self, context, reduce) -> OuterOptimizer:
        if context.inner_learning_rate is None:
            raise ValueError("slowmo needs Context.inner_learning_rate (the inner schedule)")
        lr = context.inner_learning_rate
        gamma = (lambda t: lr(t * context.sync_every)) if callable(lr) else lr
        return slowmo(gamma, self.learning_rate, self.momentum, reduce=reduce)
