"""The per-step adapter: an outer optimizer inside any optax training loop."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from co2jax._base import OuterOptimizer, check_int, check_transform


class LocalUpdatesState(NamedTuple):
    """State of :func:`local_updates` (one per replica).

    Attributes:
      inner_state: the inner optax transform's state (replica-varying; not reset at syncs).
      outer_state: the outer optimizer's state (see its own documentation).
      count: 0-d int32, the number of steps taken so far.
    """

    inner_state: optax.OptState
    outer_state: Any
    count: jax.Array


def local_updates(
    inner: optax.GradientTransformation, outer: OuterOptimizer, sync_every: int
) -> optax.GradientTransformationExtraArgs:
    """Runs ``inner`` every step and ``outer.sync`` every ``sync_every``-th step.

    Each call applies ``inner`` to the gradients. On every ``sync_every``-th call the adapter
    then runs ``outer.sync`` on the parameters that step produced, and the returned updates
    take ``params`` to what ``sync`` returned (``synced - params``, exact up to one rounding
    of the addition in ``optax.apply_updates``). The sync runs inside ``lax.cond``, so its
    collective runs only on sync steps; the state has the same types on every step, so the
    step compiles once.

    Call ``update`` with the replica's current ``params``, inside an axis named like the outer
    optimizer's (``jax.vmap(..., axis_name="replica")`` or ``jax.shard_map``). Under ``vmap``
    with a per-replica step counter the ``cond`` becomes a select and both branches are
    evaluated (a simulation has no communication to save); under ``shard_map`` it is a real
    branch. Under ``shard_map``, pass the parameters and state replica-varying (a leading
    replica axis sharded over ``"replica"``).

    Args:
      inner: the inner optax transform (e.g. AdamW).
      outer: an :class:`~co2jax.OuterOptimizer`.
      sync_every: H, inner steps per round (>= 1).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with :class:`LocalUpdatesState`.

    Example:
      >>> import jax, jax.numpy as jnp, optax, co2jax
      >>> tx = co2jax.local_updates(optax.sgd(0.5), co2jax.local_sgd(), sync_every=2)
      >>> params = jnp.zeros((2, 1))              # two replicas
      >>> state = jax.vmap(tx.init)(params)
      >>> grads = jnp.array([[-1.0], [-3.0]])     # different data on each replica
      >>> step = jax.vmap(tx.update, axis_name="replica")
      >>> for _ in range(2):
      ...     updates, state = step(grads, state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> params  # after 2 local steps, [1.0] and [3.0] averaged
      Array([[2.],
             [2.]], dtype=float32)
    """
    check_transform("inner", inner)
    if not isinstance(outer, OuterOptimizer):
        raise ValueError(f"outer must be a co2jax.OuterOptimizer, got outer={outer!r}")
    sync_every = check_int("sync_every", sync_every, 1)
    inner = optax.with_extra_args_support(inner)

    def init(params: optax.Params) -> LocalUpdatesState:
        return LocalUpdatesState(inner.init(params), outer.init(params), jnp.zeros([], jnp.int32))

    def update(grads, state: LocalUpdatesState, params=None, **extra_args):
        if params is None:
            raise ValueError("local_updates needs params: call update(grads, state, params)")
        updates, inner_state = inner.update(grads, state.inner_state, params, **extra_args)
        count = state.count + 1

        def sync(outer_state):
            local = optax.apply_updates(params, updates)
            synced, outer_state = outer.sync(local, outer_state)
            moved = jax.tree.map(lambda s, p, u: (s - p).astype(u.dtype), synced, params, updates)
            return moved, outer_state

        def skip(outer_state):
            return updates, outer_state

        updates, outer_state = jax.lax.cond(count % sync_every == 0, sync, skip, state.outer_state)
        return updates, LocalUpdatesState(inner_state, outer_state, count)

    return optax.GradientTransformationExtraArgs(init, update)
