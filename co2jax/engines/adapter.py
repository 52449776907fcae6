"""The per-step adapter: an outer optimizer inside any optax training loop."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from co2jax._checks import check_int, check_transform
from co2jax.comm import chunks
from co2jax.comm.reducer import Reducer, as_reducer, values
from co2jax.protocol import OuterOptimizer, Transfer, chunk_steps, payload_shapes, resolve
from co2jax.protocol import spread as spread_schedule
from co2jax.tree import tree_all_finite, tree_select


class LocalUpdatesState(NamedTuple):
    """State of :func:`local_updates` (one per replica).

    Attributes:
      inner_state: the inner optax transform's state (replica-varying; not reset at syncs).
      outer_state: the outer optimizer's state (see its own documentation).
      count: 0-d int32, the number of steps taken so far.
      inflight: per transfer of the schedule, what is on the wire between its send and its
        apply: the reduced payload, or for a transfer in chunks its payload cut into chunks
        (``[chunks, size]`` per leaf), each replaced by its reduction once reduced; ``()``
        for a transfer sent and applied at the same step.
    """

    inner_state: optax.OptState
    outer_state: Any
    count: jax.Array
    inflight: tuple = ()


def local_updates(
    inner: optax.GradientTransformation,
    outer: OuterOptimizer,
    sync_every: int,
    *,
    spread: bool | None = None,
    reduce: Reducer | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Runs ``inner`` every step and ``outer``'s schedule of transfers around the steps.

    Each call applies ``inner`` to the gradients, then does what the outer optimizer's
    schedule (:func:`co2jax.protocol.plan`) puts at this step of the round: a transfer is
    sent (and reduced) before the step whose index is its send step, with the parameters the
    call receives, and applied after the step that completes its apply step, on the
    parameters that step produced; the returned updates take ``params`` there (exact up to
    one rounding of the addition in ``optax.apply_updates``). Every communication runs inside
    ``lax.cond``, so its collective runs only on the steps it belongs to; the state has the
    same types on every step, so the step compiles once.

    Call ``update`` with the replica's current ``params``, inside an axis named like the outer
    optimizer's (``jax.vmap(..., axis_name="replica")`` or ``jax.shard_map``). Under ``vmap``
    with a per-replica step counter the ``cond`` becomes a select and both branches are
    evaluated (a simulation has no communication to save); under ``shard_map`` it is a real
    branch. Under ``shard_map``, pass the parameters and state replica-varying (a leading
    replica axis sharded over ``"replica"``).

    **Spreading a transfer over the steps it spans** (``spread``). A delayed algorithm sends
    at step 0 a payload it applies at the end of the round. With ``spread=True`` (the
    default) it is cut into a chunk per step, and step k reduces
    chunk k, independent of that step's forward and backward pass, so each step's program can
    hide its small collective behind its compute: the same bytes, 1/H of the peak bandwidth.
    An exact mean is element-wise, so the assembled values equal the unchunked reduction
    exactly, and so do the blocks of a compressed payload, which chunks never split
    (:mod:`co2jax.comm.chunks`). Costs one payload-sized buffer (two for a payload error
    feedback sends encoded). On TPU pass a reduction that the compiler overlaps,
    ``reduce=co2jax.comm.all_gather_mean()`` (see docs/overlap.md).

    Args:
      inner: the inner optax transform (e.g. AdamW).
      outer: an :class:`~co2jax.OuterOptimizer`.
      sync_every: H, inner steps per round (>= 1).
      spread: cut every transfer sent before its apply step into a chunk per step (the
        default, ``None``, where the reducer is ``chunkable``). ``True`` needs such a
        transfer and a chunkable reducer.
      reduce: the reduction to use (default: ``outer.reducer``).

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
    H = check_int("sync_every", sync_every, 1)
    planned = resolve(outer, H)
    if spread and not outer.overlapped:
        raise ValueError(
            "spread=True needs a transfer sent before the step it is applied at (a delayed "
            "outer optimizer); this one sends and applies every transfer at the same step"
        )
    reducer = outer.reducer if reduce is None else as_reducer(reduce)
    inner = optax.with_extra_args_support(inner)

    def payloads(params, outer_state) -> list:
        return [payload_shapes(outer, params, outer_state, i) for i in range(len(planned))]

    if spread and not reducer.chunkable:
        raise ValueError(
            f"spread={spread!r}: the reducer {reducer.name!r} sends its payload only whole "
            "(it cannot be cut into chunks); use spread=None or False"
        )
    whole = spread is False or not reducer.chunkable
    run = planned if whole else spread_schedule(planned)  # the schedule as run

    def init(params: optax.Params) -> LocalUpdatesState:
        outer_state = outer.init(params)
        inflight, shapes = [], payloads(params, outer_state)
        for t, payload in zip(run, shapes, strict=True):
            if t.send == t.apply:
                inflight.append(())
            elif t.chunks == 1:
                reduced = jax.eval_shape(values, payload)
                inflight.append(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), reduced))
            else:
                plan = chunks.plan(payload, reducer, t.chunks)
                zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), payload)
                acc = chunks.zeros(plan) if plan.encoded else None
                inflight.append({"wire": chunks.split(plan, zeros), "acc": acc})
        count = jnp.zeros([], jnp.int32)
        return LocalUpdatesState(inner.init(params), outer_state, count, tuple(inflight))

    def update(grads, state: LocalUpdatesState, params=None, **extra_args):
        if params is None:
            raise ValueError("local_updates needs params: call update(grads, state, params)")
        k = state.count % H
        shapes = payloads(params, state.outer_state)
        outer_state, inflight = state.outer_state, list(state.inflight)

        # before the step: sends, then the chunks due now
        for i, t in enumerate(run):
            if t.send == t.apply:
                continue

            def send(carry, i=i, t=t):
                payload, ostate = outer.send(params, carry[0], i)
                if t.chunks == 1:
                    return ostate, _typed_like(values(reducer(payload)), carry[1])
                wire = chunks.split(chunks.plan(payload, reducer, t.chunks), payload)
                return ostate, {**carry[1], "wire": wire}

            outer_state, inflight[i] = jax.lax.cond(
                k == t.send, send, lambda carry: carry, (outer_state, inflight[i])
            )
        for i, t in enumerate(run):
            if t.chunks > 1:
                plan = chunks.plan(shapes[i], reducer, t.chunks)
                inflight[i] = _reduce_chunk(reducer, t, H, k, inflight[i], plan)

        updates, inner_state = inner.update(grads, state.inner_state, params, **extra_args)
        if outer.recovers_nonfinite:  # a NaN step is skipped: params can't be reset later
            ok = tree_all_finite(updates) & tree_all_finite(inner_state)
            updates = tree_select(ok, updates, jax.tree.map(jnp.zeros_like, updates))
            inner_state = tree_select(ok, inner_state, state.inner_state)
        local = optax.apply_updates(params, updates)

        # after the step: the transfers applied at the boundary it completes
        for i, t in enumerate(run):

            def finish(carry, i=i, t=t):
                local, ostate, held = carry
                if t.send == t.apply:
                    payload, ostate = outer.send(local, ostate, i)
                    reduced = reducer(payload)
                elif t.chunks == 1:
                    reduced = held
                else:
                    plan = chunks.plan(shapes[i], reducer, t.chunks)
                    reduced = chunks.finish(plan, held["acc"] if plan.encoded else held["wire"])
                local, ostate = outer.apply(local, ostate, i, reduced)
                return local, ostate, held

            local, outer_state, inflight[i] = jax.lax.cond(
                k + 1 == t.apply, finish, lambda carry: carry, (local, outer_state, inflight[i])
            )
        moved = jax.tree.map(lambda s, p, u: (s - p).astype(u.dtype), local, params, updates)
        count = state.count + 1
        return moved, LocalUpdatesState(inner_state, outer_state, count, tuple(inflight))

    return optax.GradientTransformationExtraArgs(init, update)


def _typed_like(new: Any, old: Any) -> Any:
    """``new`` in ``old``'s dtypes and varying mesh axes (a ``lax.cond`` branch must return
    what the other returns: under ``shard_map`` a reduced value is replica-invariant, the
    buffer it goes into is not); the select is on a constant, which XLA folds away."""
    return jax.tree.map(lambda n, o: jnp.where(True, n.astype(o.dtype), o), new, old)


def _reduce_chunk(reducer, t: Transfer, H: int, k, held: dict, plan):
    """Reduces the chunk of ``t`` due at step ``k`` (if any): a plain payload's chunk in place
    of its wire chunk, an encoded one's into ``acc``."""

    def reduce(held, c):
        reduced = chunks.reduce(plan, reducer, chunks.take(held["wire"], c))
        if plan.encoded:
            return {**held, "acc": chunks.put(held["acc"], c, reduced)}
        return {**held, "wire": chunks.put(held["wire"], c, reduced)}

    steps = chunk_steps(t)
    if steps == list(range(H)):  # a chunk every step: no branch, each step's collective
        return reduce(held, k)  # is independent of that step's gradients
    table = np.full(H, -1, np.int32)
    table[steps] = np.arange(t.chunks)
    c = jnp.asarray(table)[k]
    return jax.lax.cond(c >= 0, lambda h: reduce(h, jnp.maximum(c, 0)), lambda h: h, held)
