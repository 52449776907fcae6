"""The per-step adapter: an outer optimizer inside any optax training loop."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from co2jax._base import OuterOptimizer, Reducer, check_int, check_transform


class LocalUpdatesState(NamedTuple):
    """State of :func:`local_updates` (one per replica).

    Attributes:
      inner_state: the inner optax transform's state (replica-varying; not reset at syncs).
      outer_state: the outer optimizer's state (see its own documentation).
      count: 0-d int32, the number of steps taken so far.
      reduced: with ``spread``, the reduced payload assembled chunk by chunk during the
        round (payload-shaped; replica-invariant values); ``()`` otherwise.
    """

    inner_state: optax.OptState
    outer_state: Any
    count: jax.Array
    reduced: Any = ()


def _chunk(x: jax.Array, k: jax.Array, size: int) -> jax.Array:
    """Elements [k*size, (k+1)*size) of ``x`` flattened, the start clamped to stay in bounds."""
    flat = x.reshape(-1)
    start = jnp.minimum(k * size, flat.size - size)
    return jax.lax.dynamic_slice_in_dim(flat, start, size)


def _unchunk(acc: jax.Array, piece: jax.Array, k: jax.Array, size: int) -> jax.Array:
    flat = acc.reshape(-1)
    start = jnp.minimum(k * size, flat.size - size)
    return jax.lax.dynamic_update_slice_in_dim(flat, piece, start, 0).reshape(acc.shape)


def local_updates(
    inner: optax.GradientTransformation,
    outer: OuterOptimizer,
    sync_every: int,
    *,
    spread: bool | None = None,
    reduce: Reducer | None = None,
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

    **Spreading a delayed reduction over the round** (``spread``). A delayed algorithm
    (``outer.staleness >= 1``) reduces at the end of round t a payload it already had at the
    start of it. With ``spread=True`` (the default for delayed algorithms) each leaf of that
    payload is cut into H chunks and step k of the round reduces chunk k, independent of that
    step's forward and backward pass, so each step's program can hide its small collective
    behind its compute: the same bytes, 1/H of the peak bandwidth. The sync then applies the
    assembled result. The reduction is element-wise, so the assembled values equal the
    unchunked reduction exactly. (The last chunk's start is clamped into bounds: a few
    elements are reduced twice, to the same values.) Costs one payload-sized buffer. On TPU
    pass a reduction that the compiler overlaps,
    ``reduce=co2jax.reducers.all_gather_mean()`` (see docs/overlap.md).

    Args:
      inner: the inner optax transform (e.g. AdamW).
      outer: an :class:`~co2jax.OuterOptimizer`.
      sync_every: H, inner steps per round (>= 1).
      spread: spread a delayed reduction over the round's steps; default: True when
        ``outer.staleness >= 1``. Requires ``outer.staleness >= 1``.
      reduce: the reduction for the spread chunks (default: ``outer.reduce``).

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
    if spread is None:
        spread = outer.staleness >= 1
    if spread and outer.staleness < 1:
        raise ValueError(
            f"spread=True needs a delayed outer optimizer (staleness >= 1), got "
            f"staleness={outer.staleness}"
        )
    reduce = outer.reduce if reduce is None else reduce
    inner = optax.with_extra_args_support(inner)

    def init(params: optax.Params) -> LocalUpdatesState:
        outer_state = outer.init(params)
        reduced: Any = ()
        if spread:
            shapes = jax.eval_shape(outer.payload, params, outer_state)
            reduced = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        return LocalUpdatesState(inner.init(params), outer_state, jnp.zeros([], jnp.int32), reduced)

    def reduce_chunk(params, state: LocalUpdatesState):
        """Reduces chunk k (this step's index in the round) of the round's delayed payload."""
        payload = outer.payload(params, state.outer_state)  # reads the state only
        k = state.count % sync_every
        leaves, treedef = jax.tree.flatten(payload)
        sizes = [max(1, -(-x.size // sync_every)) for x in leaves]
        pieces = [_chunk(x, k, n) for x, n in zip(leaves, sizes, strict=True)]
        pieces = jax.tree.leaves(reduce(jax.tree.unflatten(treedef, pieces)))
        acc = jax.tree.leaves(state.reduced)
        acc = [_unchunk(a, p, k, n) for a, p, n in zip(acc, pieces, sizes, strict=True)]
        return jax.tree.unflatten(treedef, acc)

    def update(grads, state: LocalUpdatesState, params=None, **extra_args):
        if params is None:
            raise ValueError("local_updates needs params: call update(grads, state, params)")
        updates, inner_state = inner.update(grads, state.inner_state, params, **extra_args)
        count = state.count + 1
        reduced = reduce_chunk(params, state) if spread else ()

        def sync(outer_state):
            local = optax.apply_updates(params, updates)
            if spread:
                synced, outer_state = outer.apply(local, outer_state, reduced)
            else:
                synced, outer_state = outer.sync(local, outer_state)
            moved = jax.tree.map(lambda s, p, u: (s - p).astype(u.dtype), synced, params, updates)
            return moved, outer_state

        def skip(outer_state):
            return updates, outer_state

        updates, outer_state = jax.lax.cond(count % sync_every == 0, sync, skip, state.outer_state)
        return updates, LocalUpdatesState(inner_state, outer_state, count, reduced)

    return optax.GradientTransformationExtraArgs(init, update)
