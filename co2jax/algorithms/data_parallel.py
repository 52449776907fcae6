"""The data-parallel (DDP) baseline as an optax transform."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import optax

from co2jax._checks import check_axis_name, check_transform
from co2jax.algorithms.registry import register
from co2jax.algorithms.settings import Settings, setting
from co2jax.axes import REPLICA, axis_size
from co2jax.comm.reducer import pmean, ring_bytes
from co2jax.protocol import OuterOptimizer
from co2jax.tree import tree_bytes


def data_parallel(
    inner: optax.GradientTransformation, *, axis_name: str = REPLICA
) -> optax.GradientTransformationExtraArgs:
    """Averages gradients over the replica axis every step, then applies ``inner``.

    ``g-bar = mean_r g_r; theta <- theta + inner(g-bar)``. The yardstick for quality and
    traffic: one all-reduce of the full gradient per step.

    Args:
      inner: the optax transform applied to the averaged gradient.
      axis_name: the replica axis.

    Example:
      >>> import jax, jax.numpy as jnp, optax, co2jax
      >>> opt = co2jax.data_parallel(optax.sgd(1.0))
      >>> state = jax.vmap(opt.init)(jnp.zeros((2, 1)))
      >>> updates, state = jax.jit(jax.vmap(opt.update, axis_name="replica"))(
      ...     jnp.array([[1.0], [3.0]]), state)
      >>> updates
      Array([[-2.],
             [-2.]], dtype=float32)
    """
    check_transform("inner", inner)
    check_axis_name("axis_name", axis_name)
    inner = optax.with_extra_args_support(inner)

    def update(updates, state, params=None, **extra_args):
        axis_size(axis_name)
        updates = jax.tree.map(lambda g: jax.lax.pmean(g, axis_name), updates)
        return inner.update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(inner.init, update)


class NoSyncState(NamedTuple):
    """State of :func:`no_sync` (empty)."""


def no_sync() -> OuterOptimizer:
    """An outer optimizer that does nothing: the sync returns the parameters unchanged.

    Its schedule is empty: nothing crosses the replica axis at a sync. With
    :func:`data_parallel` as the inner transform (gradients already averaged over the
    replica axis every step), :class:`co2jax.RoundTrainer` runs plain DDP.

    Example:
      >>> import jax.numpy as jnp, co2jax
      >>> outer = co2jax.no_sync()
      >>> outer.sync(jnp.ones(2), outer.init(jnp.ones(2)))  # no axis needed: nothing to reduce
      (Array([1., 1.], dtype=float32), NoSyncState())
    """
    return OuterOptimizer(
        init=lambda params: NoSyncState(),
        send=lambda params, state, i: ((), state),
        reducer=pmean(),
        apply=lambda params, state, i, reduced: (params, state),
        schedule=(),
    )


@register("data-parallel baseline: gradients all-reduced every step")
@dataclasses.dataclass(frozen=True)
class DDPSettings(Settings):
    """DDP's settings: none (its inner transform averages the gradients every step)."""

    algorithm: str = setting("ddp", "the algorithm")

    def build(self, context, reduce) -> OuterOptimizer:
        return no_sync()

    def inner(self, transform, context):
        return data_parallel(transform)

    def step_bytes(self, params, replicas: int, sync_every: int) -> float:
        return ring_bytes(tree_bytes(params), replicas)
