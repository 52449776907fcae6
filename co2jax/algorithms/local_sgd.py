"""Local SGD: periodic model averaging (Stich 2018, arXiv 1805.09767)."""

from __future__ import annotations

import dataclasses

import optax

from co2jax.algorithms.pseudo_gradient import pseudo_gradient_method
from co2jax.algorithms.registry import register
from co2jax.algorithms.settings import Guard, Settings, setting
from co2jax.axes import REPLICA
from co2jax.comm.reducer import Reducer
from co2jax.protocol import OuterOptimizer


def local_sgd(*, axis_name: str = REPLICA, reduce: Reducer | None = None) -> OuterOptimizer:
    """Periodic model averaging: every replica restarts from the replicas' mean.

    .. math::

        \\theta^{(t+1)} = \\operatorname{mean}_r \\theta_r^{(t,H)}
                        = \\theta^{(t)} - \\bar\\Delta^{(t)}

    It is DiLoCo with the outer optimizer ``optax.sgd(1.0)``; the averaged quantity is the
    pseudo-gradient, so the anchor kept in the state is what replicas restart from after a
    skipped (non-finite) sync.

    Args:
      axis_name: the replica axis.
      reduce: the cross-replica reduction (default: mean over ``axis_name``).

    Returns:
      An :class:`~co2jax.OuterOptimizer` with
      :class:`~co2jax.algorithms.pseudo_gradient.PseudoGradientState`.

    Example:
      >>> import jax, jax.numpy as jnp, co2jax
      >>> outer = co2jax.local_sgd()
      >>> state = jax.vmap(outer.init)(jnp.zeros((2, 1)))   # two replicas, anchor 0
      >>> local = jnp.array([[1.0], [3.0]])                 # after their inner steps
      >>> params, state = jax.jit(jax.vmap(outer.sync, axis_name="replica"))(local, state)
      >>> params
      Array([[2.],
             [2.]], dtype=float32)

    References:
      Stich, "Local SGD converges fast and communicates little", arXiv 1805.09767.
    """
    return pseudo_gradient_method(optax.scale(-1.0), axis_name=axis_name, reduce=reduce)


@register("periodic model averaging")
@dataclasses.dataclass(frozen=True)
class LocalSGDSettings(Settings, Guard):
    """Local SGD's settings: none of its own."""

    algorithm: str = setting("local_sgd", "the algorithm")

    def build(self, context, reduce) -> OuterOptimizer:
        return local_sgd(reduce=reduce)
