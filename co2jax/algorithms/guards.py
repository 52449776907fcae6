"""Guards around outer optimizers."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from co2jax.protocol import OuterOptimizer, Params, StateRoles, anchor_of, checked_roles, roles_of
from co2jax.tree import all_over_shards, tree_all_finite, tree_select


@checked_roles
class SkipNonfiniteState(NamedTuple):
    """State of :func:`skip_nonfinite`.

    Attributes:
      inner_state: the wrapped outer optimizer's state.
      num_skipped: 0-d int32, how many syncs were skipped (replica-invariant).
    """

    inner_state: Any
    num_skipped: jax.Array

    ROLES = StateRoles(wraps="inner_state")


def skip_nonfinite(outer: OuterOptimizer) -> OuterOptimizer:
    """Skips the outer step when the averaged pseudo-gradient has a NaN or an Inf.

    At a sync whose reduced payload (the averaged pseudo-gradient about to be applied) or
    resulting anchor is not finite everywhere, the anchor and the outer optimizer's state stay
    as they were, every replica restarts from that unchanged anchor, and ``num_skipped``
    counts it. The reduced payload and the anchor are identical on every replica, so every
    replica takes the same decision. Delayed algorithms still advance their in-flight
    pseudo-gradients: the one produced this round is sent as usual (if it is the non-finite
    one, the next sync is skipped in turn, and the replicas, restarted from a finite anchor,
    recover).

    The wrapped state must have an ``anchor`` field (every algorithm in co2jax has one), and
    the anchor must be replica-invariant: eager updates (``outer.replica_local``) are refused,
    because a skip taken by some replicas and not others would leave their replica-local
    anchors apart for good (their eager terms no longer telescope).

    Given the replicas' payloads un-reduced (:class:`co2jax.kernels.Gathered`, from the round
    engine's all-gather), the check is that every payload is finite, which their mean is
    unless finite payloads overflow when summed.

    A replica whose inner optimizer state went non-finite (AdamW moments after a NaN
    gradient) would poison every later round: the round engine restarts such a replica from
    the anchor (:mod:`co2jax.engines.recovery`: ``inner.init`` of the anchor) at the
    round's end, and
    ``local_updates`` skips a non-finite inner step (zero updates, the inner state kept, the
    step counted, so replicas stay in step). One bad batch costs one round (the round
    engine) or one step (``local_updates``). Wrap it *inside* the engine, never with
    ``optax.apply_if_finite`` around ``local_updates`` (which skips the whole call, the
    sync's bookkeeping with it, on some replicas and not others).

    After a skip, :func:`co2jax.co2`'s penalty sees ``theta^(t) + alpha*m`` as the previous
    anchor, i.e. the anchor before the last *applied* step, although the stale pseudo-gradients
    were computed from the unchanged anchor.

    Example:
      >>> import jax, jax.numpy as jnp, co2jax
      >>> outer = co2jax.skip_nonfinite(co2jax.local_sgd())
      >>> state = jax.vmap(outer.init)(jnp.zeros((2, 1)))
      >>> params, state = jax.jit(jax.vmap(outer.sync, axis_name="replica"))(
      ...     jnp.array([[1.0], [jnp.nan]]), state)
      >>> params, state.num_skipped
      (Array([[0.],
             [0.]], dtype=float32), Array([1, 1], dtype=int32))
    """

    if len(outer.schedule) != 1:
        raise ValueError(
            "skip_nonfinite decides once per round; got an outer optimizer with "
            f"{len(outer.schedule)} transfers per round (Streaming DiLoCo syncs per fragment)"
        )
    if outer.replica_local:
        raise ValueError(
            "skip_nonfinite needs a replica-invariant anchor; got an outer optimizer with "
            "replica_local=True (eager updates keep replica-local anchors)"
        )

    def init(params: Params) -> SkipNonfiniteState:
        inner = outer.init(params)
        if anchor_of(inner) is None:
            raise TypeError(
                "skip_nonfinite needs an outer state that declares an anchor (the parameters "
                f"replicas restart from, co2jax.protocol.StateRoles); got state of type "
                f"{type(inner).__name__}"
            )
        return SkipNonfiniteState(inner, jnp.zeros([], jnp.int32))

    def send(params: Params, state: SkipNonfiniteState, i: int):
        payload, inner = outer.send(params, state.inner_state, i)
        return payload, state._replace(inner_state=inner)

    def apply(params: Params, state: SkipNonfiniteState, i: int, reduced: Any):
        new_params, new_inner = outer.apply(params, state.inner_state, i, reduced)
        # one shard's NaN skips the step for every shard (shard_outer_state), needs check_vma
        ok = all_over_shards(tree_all_finite(reduced) & tree_all_finite(new_params))
        kept = state.inner_state
        # in-flight bookkeeping advances even on a skip: this round's pseudo-gradient is sent
        # as usual and the sync count keeps counting syncs
        for field in roles_of(kept).advances:
            kept = kept._replace(**{field: getattr(new_inner, field)})
        inner = tree_select(ok, new_inner, kept)
        params_out = tree_select(ok, new_params, anchor_of(state.inner_state))
        skipped = state.num_skipped + jnp.logical_not(ok).astype(jnp.int32)
        return params_out, SkipNonfiniteState(inner, skipped)

    return outer._replace(init=init, send=send, apply=apply, recovers_nonfinite=True)
