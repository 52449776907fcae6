"""The per-step adapter: an outer optimizer inside any optax training loop."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from co2jax._checks import check_int, check_transform
from co2jax.algorithms.gpa import check_inner_under_outer
from co2jax.comm import chunks
from co2jax.comm.reducer import Reducer, as_reducer, values
from co2jax.engines.walk import walk
from co2jax.protocol import (
    OuterOptimizer,
    Transfer,
    act,
    chunk_steps,
    payload_shapes,
    resolve,
)
from co2jax.protocol import spread as spread_schedule
from co2jax.tree import tree_all_finite, tree_select


class LocalUpdatesState(NamedTuple):
    """State of :func:`local_updates` (one per replica).

    Attributes:
      inner_state: the inner optax transform's state (replica-varying; not reset at syncs).
      outer_state: the outer optimizer's state (see its own documentation).
      count: 0-d int32, the number of steps taken so far.
      inflight: per transfer of the schedule, what is on the wire between its send and its
        apply: the reduced payload, or for a transfer in chunks a
        :class:`co2jax.comm.chunks.Buffer`; ``()`` for a transfer sent and applied at the
        same step.
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
      >>> step = jax.jit(jax.vmap(tx.update, axis_name="replica"))
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
    if spread and not reducer.chunkable:
        raise ValueError(
            f"spread={spread!r}: the reducer {reducer.name!r} sends its payload only whole "
            "(it cannot be cut into chunks); use spread=None or False"
        )
    whole = spread is False or not reducer.chunkable
    run = planned if whole else spread_schedule(planned)  # the schedule as run
    schedule = walk(run, H)

    def payloads(params, outer_state) -> list:
        return [payload_shapes(outer, params, outer_state, i) for i in range(len(run))]

    def init(params: optax.Params) -> LocalUpdatesState:
        check_inner_under_outer(inner, outer, params)
        # the outer state keeps its own copy of the parameters (an anchor is the parameters
        # at init): a step that donates both, jax.jit(step, donate_argnums=(0, 1)), must not
        # be handed one buffer twice
        outer_state = outer.init(jax.tree.map(jnp.copy, params))
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
                inflight.append(chunks.fill(plan, zeros))
        count = jnp.zeros([], jnp.int32)
        return LocalUpdatesState(inner.init(params), outer_state, count, tuple(inflight))

    def update(grads, state: LocalUpdatesState, params=None, **extra_args):
        if params is None:
            raise ValueError("local_updates needs params: call update(grads, state, params)")
        k = state.count % H
        driver = _Driver(outer, run, reducer, payloads(params, state.outer_state))
        carry = _Carry(params, state.outer_state, tuple(state.inflight))
        # before the step: the sends at boundary k, then the chunks due before step k
        carry = _at_step(k, H, schedule.before, driver, carry, moves_params=False)
        for i, t in enumerate(run):
            if t.chunks > 1:
                carry = _chunk_due(k, H, t, i, driver, carry)
        updates, inner_state = inner.update(grads, state.inner_state, params, **extra_args)
        if outer.recovers_nonfinite:  # a NaN step is skipped: params can't be reset later
            ok = tree_all_finite(updates) & tree_all_finite(inner_state)
            updates = tree_select(ok, updates, jax.tree.map(jnp.zeros_like, updates))
            inner_state = tree_select(ok, inner_state, state.inner_state)
        local = optax.apply_updates(params, updates)
        # after the step: the transfers applied at the boundary it completes
        carry = _at_step(k, H, schedule.after, driver, carry._replace(params=local), True)
        moved = jax.tree.map(lambda s, p, u: (s - p).astype(u.dtype), carry.params, params, updates)
        count = state.count + 1
        new = LocalUpdatesState(inner_state, carry.outer_state, count, carry.inflight)
        return moved, new

    return optax.GradientTransformationExtraArgs(init, update)


class _Carry(NamedTuple):
    params: Any
    outer_state: Any
    inflight: tuple


class _Driver:
    """The adapter's send, chunk and apply (what :func:`co2jax.protocol.act` runs); its
    steps are the optax loop's, one per call."""

    def __init__(self, outer: OuterOptimizer, run: tuple, reducer: Reducer, shapes: list):
        self.outer, self.run, self.reducer, self.shapes = outer, run, reducer, shapes
        self.synced: dict[int, Any] = {}  # sent and applied in one boundary: never stored

    def _hold(self, c: _Carry, i: int, held) -> _Carry:
        return c._replace(inflight=(*c.inflight[:i], held, *c.inflight[i + 1 :]))

    def _plan(self, i: int):
        return chunks.plan(self.shapes[i], self.reducer, self.run[i].chunks)

    def send(self, c: _Carry, i: int) -> _Carry:
        t = self.run[i]
        payload, state = self.outer.send(c.params, c.outer_state, i)
        c = c._replace(outer_state=state)
        if t.send == t.apply:
            self.synced[i] = self.reducer(payload)
            return c
        if t.chunks == 1:
            return self._hold(c, i, _typed_like(values(self.reducer(payload)), c.inflight[i]))
        return self._hold(c, i, c.inflight[i]._replace(wire=chunks.split(self._plan(i), payload)))

    def chunk(self, c: _Carry, i: int, k: Any) -> _Carry:
        buffer, _, _ = chunks.reduce_chunk(self._plan(i), self.reducer, c.inflight[i], k)
        return self._hold(c, i, buffer)

    def apply(self, c: _Carry, i: int) -> _Carry:
        t = self.run[i]
        if t.send == t.apply:
            reduced = self.synced.pop(i)
        elif t.chunks == 1:
            reduced = c.inflight[i]
        else:
            reduced = chunks.result(self._plan(i), c.inflight[i])
        params, state = self.outer.apply(c.params, c.outer_state, i, reduced)
        return c._replace(params=params, outer_state=state)


def _at_step(k, H: int, actions_of, driver: _Driver, carry: _Carry, moves_params: bool):
    """The actions ``actions_of(j)`` of the step ``j == k`` (traced), in one ``lax.switch``
    over the distinct action lists (none: nothing runs). Unless the actions may move the
    parameters (applies), the parameters are closed over, not passed: a branch that does
    not read them (a delayed payload's send) leaves its outputs independent of them."""
    branches: list = []
    table = np.zeros(H, np.int32)
    for j in range(H):
        actions = actions_of(j)
        if not actions:
            continue
        key = tuple((a.kind, a.transfer) for a in actions)
        found = [n for n, (other, _) in enumerate(branches) if other == key]
        if not found:
            branches.append((key, actions))
            found = [len(branches) - 1]
        table[j] = found[0] + 1
    if not branches:
        return carry
    if moves_params:
        run = lambda actions: lambda c: act(driver, c, actions)
        operand, rebuild = carry, lambda out: out
    else:

        def run(actions):
            def branch(rest):
                c = act(driver, carry._replace(outer_state=rest[0], inflight=rest[1]), actions)
                return c.outer_state, c.inflight

            return branch

        operand = (carry.outer_state, carry.inflight)
        rebuild = lambda out: carry._replace(outer_state=out[0], inflight=out[1])
    fns = [lambda c: c] + [run(actions) for _, actions in branches]
    if len(fns) == 2:  # a cond: under vmap a select, under shard_map a real branch
        return rebuild(jax.lax.cond(jnp.asarray(table)[k] > 0, fns[1], fns[0], operand))
    return rebuild(jax.lax.switch(jnp.asarray(table)[k], fns, operand))


def _typed_like(new: Any, old: Any) -> Any:
    """``new`` in ``old``'s dtypes and varying mesh axes (a ``lax.cond`` branch must return
    what the other returns: under ``shard_map`` a reduced value is replica-invariant, the
    buffer it goes into is not); the select is on a constant, which XLA folds away."""
    return jax.tree.map(lambda n, o: jnp.where(True, n.astype(o.dtype), o), new, old)


def _chunk_due(k, H: int, t: Transfer, i: int, driver: _Driver, carry: _Carry) -> _Carry:
    """Reduces the chunk of transfer ``i`` due before step ``k`` (if any)."""
    steps = chunk_steps(t)
    if steps == list(range(H)):  # a chunk every step: no branch, each step's collective
        return driver.chunk(carry, i, k - t.send)  # is independent of that step's gradients
    table = np.full(H, -1, np.int32)
    table[steps] = np.arange(t.chunks)
    c = jnp.asarray(table)[k]
    return jax.lax.cond(c >= 0, lambda h: driver.chunk(h, i, jnp.maximum(c, 0)), lambda h: h, carry)
