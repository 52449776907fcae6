"""Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512): one fragment on the wire at a time.

The parameters are split into P :mod:`co2jax.fragments`. Within a round of H inner steps,
fragment p is *applied* after step ``s_p = (p + 1) * H // P`` and *sent* ``tau`` steps
earlier, after step ``s_p - tau``. Per replica r, with the fragment's global copy
``theta~_p`` (its value at its last sync):

.. math::

    \\Delta_{r,p} &= \\tilde\\theta_p - \\theta_{r,p} \\quad\\text{(at step } s_p - \\tau) \\\\
    \\tilde\\theta_p &\\leftarrow \\tilde\\theta_p + \\mathrm{OuterOpt}_p(
        \\operatorname{mean}_r \\Delta_{r,p}) \\quad\\text{(at step } s_p) \\\\
    \\theta_{r,p} &\\leftarrow \\alpha\\,\\theta_{r,p} + (1 - \\alpha)\\,\\tilde\\theta_p

Each fragment keeps its own outer-optimizer state, syncs once every H steps, and its
reduction has ``tau`` inner steps to hide behind: the round engine issues it as a
:class:`~co2jax.segments.Issue` at ``s_p - tau`` and consumes it at ``s_p``. ``alpha = 1``
keeps the replica's local values (only the global copy moves); ``alpha = 0`` replaces them by
the new global copy, discarding the ``tau`` overlapped steps' progress on that fragment.
With P = 1, tau = 0 and alpha = 0 this is DiLoCo.

Schedule convention: the offsets are those of torchft's Streaming DiLoCo (fragment p syncs
at steps ``(p + 1) * H / P + k * H``); the paper names the send step ``t_p`` and merges at
``t_p + tau``, the same schedule with ``t_p = s_p - tau``. The recorded torchft trajectories
are reproduced in ``tests/test_streaming.py``.

Compression composes through ``reduce=`` (e.g.
:func:`co2jax.compression.all_gather_compressed` with FP4).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from co2jax._base import (
    REPLICA_AXIS,
    Params,
    Reducer,
    check_axis_name,
    check_int,
    check_transform,
    check_unit_interval,
    replica_mean,
)
from co2jax.fragments import Fragments
from co2jax.segments import Consume, Issue


class StreamingState(NamedTuple):
    """State of :func:`streaming_diloco` (one per replica).

    Attributes:
      anchor: every fragment's global copy (its value at its last sync), a params pytree.
        Replica-invariant.
      outer_states: one outer-optimizer state per fragment. Replica-invariant.
      count: 0-d int32, fragment syncs applied so far. Replica-invariant.
    """

    anchor: Params
    outer_states: tuple[Any, ...]
    count: jax.Array


class StreamingOuter(NamedTuple):
    """Streaming DiLoCo as pure functions of (params, state, fragment).

    Attributes:
      init: ``init(params) -> StreamingState``.
      payload: ``payload(params, state, p)``: fragment p's pseudo-gradient pieces.
      reduce: the cross-replica reduction of one fragment's payload.
      apply: ``apply(params, state, p, reduced) -> (params, state)``: fragment p's outer step
        and merge.
      schedule: per fragment, ``(send, apply)``: after how many of the round's inner steps
        its payload is sent and applied.
      fragments: the :class:`~co2jax.fragments.Fragments`.
      sync_every: H.
      tau: steps between send and apply.
    """

    init: Callable[[Params], StreamingState]
    payload: Callable[[Params, StreamingState, int], Any]
    reduce: Reducer
    apply: Callable[[Params, StreamingState, int, Any], tuple[Params, StreamingState]]
    schedule: tuple[tuple[int, int], ...]
    fragments: Fragments
    sync_every: int
    tau: int

    @property
    def staleness(self) -> int:
        """Steps a reduction may overlap with (the round engine's reducer choice)."""
        return self.tau

    def events(
        self,
        get: Callable[[Any], tuple[Params, StreamingState]],
        put: Callable[[Any, Params, StreamingState], Any],
        on_reduced: Callable[[Any, int, Any, Any], Any] | None = None,
    ) -> list[Issue | Consume]:
        """The round's :mod:`co2jax.segments` events for a carry.

        ``get(carry) -> (params, state)`` and ``put(carry, params, state) -> carry`` say
        where they live in the carry; ``on_reduced(carry, p, payload, reduced) -> carry``, if
        given, sees each fragment's payload and reduced value (for metrics).
        """
        out: list[Issue | Consume] = []
        for p, (send, at) in enumerate(self.schedule):

            def issue(c, p=p):
                payload = self.payload(*get(c), p)
                return payload, self.reduce(payload)

            def consume(c, value, p=p):
                payload, reduced = value
                params, state = self.apply(*get(c), p, reduced)
                c = put(c, params, state)
                return c if on_reduced is None else on_reduced(c, p, payload, reduced)

            out += [Issue(send, f"fragment{p}", issue), Consume(at, f"fragment{p}", consume)]
        return out


def schedule(sync_every: int, count: int, tau: int) -> tuple[tuple[int, int], ...]:
    """``(send, apply)`` per fragment: apply after ``(p + 1) * H // P`` steps, send ``tau``
    earlier. Needs ``0 <= tau < H // P`` so that each send comes after the previous apply."""
    return tuple(
        ((p + 1) * sync_every // count - tau, (p + 1) * sync_every // count) for p in range(count)
    )


def streaming_diloco(
    outer_optimizer: optax.GradientTransformation,
    fragments: Fragments,
    sync_every: int,
    tau: int = 1,
    alpha: float = 0.5,
    *,
    axis_name: str = REPLICA_AXIS,
    reduce: Reducer | None = None,
) -> StreamingOuter:
    """Streaming DiLoCo with one ``outer_optimizer`` state per fragment.

    Args:
      outer_optimizer: the outer optax transform (the paper: Nesterov SGD, lr 0.4 here per
        ALGORITHMS.md; ``co2jax.outer_sgd(0.4, 0.9, nesterov=True)``).
      fragments: from :func:`co2jax.fragments.make_fragments` on the parameters.
      sync_every: H, inner steps between two syncs of the same fragment (a round).
      tau: inner steps between sending a fragment's pseudo-gradient and applying it
        (``0 <= tau < H / P``).
      alpha: the merge weight of the local values, in [0, 1].
      axis_name: the replica axis.
      reduce: the reduction of one fragment's payload (default: mean over ``axis_name``).

    Example:
      >>> import jax, jax.numpy as jnp, optax, co2jax
      >>> params = {"a": jnp.zeros(1), "b": jnp.zeros(1)}
      >>> frags = co2jax.fragments.make_fragments(params, 2)
      >>> outer = co2jax.streaming_diloco(optax.sgd(1.0), frags, sync_every=4, tau=1)
      >>> outer.schedule  # fragment 0: sent after step 1, applied after step 2; fragment 1
      ((1, 2), (3, 4))
    """
    check_transform("outer_optimizer", outer_optimizer)
    if not isinstance(fragments, Fragments):
        raise ValueError(
            "fragments must be a co2jax.fragments.Fragments (make_fragments(params, P)), "
            f"got fragments={fragments!r}"
        )
    sync_every = check_int("sync_every", sync_every, 1)
    tau = check_int("tau", tau, 0)
    alpha = check_unit_interval("alpha", alpha, closed_right=True)
    check_axis_name("axis_name", axis_name)
    count = fragments.count
    if sync_every < count:
        raise ValueError(f"sync_every must be >= the fragment count {count}, got {sync_every}")
    if tau >= sync_every // count:
        raise ValueError(
            f"tau must be < H / P = {sync_every} // {count} = {sync_every // count} so that a "
            f"fragment is sent after the previous one is applied, got tau={tau}"
        )
    reduce = replica_mean(axis_name) if reduce is None else reduce

    def init(params: Params) -> StreamingState:
        if jax.tree.structure(params) != fragments.treedef:
            raise ValueError("params do not have the tree structure the fragments were made for")
        states = tuple(outer_optimizer.init(fragments.take(params, p)) for p in range(count))
        return StreamingState(params, states, jnp.zeros([], jnp.int32))

    def payload(params: Params, state: StreamingState, p: int) -> list[jax.Array]:
        anchor, local = fragments.take(state.anchor, p), fragments.take(params, p)
        return [a - x for a, x in zip(anchor, local, strict=True)]

    def apply(params: Params, state: StreamingState, p: int, reduced: Any):
        anchor = fragments.take(state.anchor, p)
        updates, new_outer = outer_optimizer.update(reduced, state.outer_states[p], anchor)
        new_global = optax.apply_updates(anchor, updates)
        local = fragments.take(params, p)
        merged = [
            (alpha * x.astype(jnp.float32) + (1.0 - alpha) * g.astype(jnp.float32)).astype(x.dtype)
            for x, g in zip(local, new_global, strict=True)
        ]
        outer_states = (*state.outer_states[:p], new_outer, *state.outer_states[p + 1 :])
        new_state = StreamingState(
            fragments.put(state.anchor, p, new_global), outer_states, state.count + 1
        )
        return fragments.put(params, p, merged), new_state

    return StreamingOuter(
        init, payload, reduce, apply, schedule(sync_every, count, tau), fragments, sync_every, tau
    )
