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
reduction has ``tau`` inner steps to hide behind: the schedule has one
:class:`~co2jax.protocol.Transfer` per fragment, sent at ``s_p - tau`` and applied at ``s_p``,
which every driver executes. ``alpha = 1``
keeps the replica's local values (only the global copy moves); ``alpha = 0`` replaces them by
the new global copy, discarding the ``tau`` overlapped steps' progress on that fragment.
With P = 1, tau = 0 and alpha = 0 this is DiLoCo.

Schedule convention: the offsets are those of torchft's Streaming DiLoCo (fragment p syncs
at steps ``(p + 1) * H / P + k * H``); the paper names the send step ``t_p`` and merges at
``t_p + tau``, the same schedule with ``t_p = s_p - tau``. The recorded torchft trajectories
are reproduced in ``tests/test_streaming.py``.

Compression composes through ``reduce=`` (e.g. :func:`co2jax.comm.all_gather_compressed`
with FP4), and error feedback through :func:`co2jax.error_feedback` (one residual per
fragment, computed from the payload actually sent).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from co2jax._checks import check_axis_name, check_int, check_transform, check_unit_interval
from co2jax.algorithms.registry import register
from co2jax.algorithms.settings import (
    Compression,
    Fragmented,
    OuterStep,
    Settings,
    setting,
)
from co2jax.axes import REPLICA
from co2jax.comm.reducer import Reducer, as_reducer
from co2jax.fragments import Fragments
from co2jax.protocol import OuterOptimizer, StateRoles, Transfer, checked_roles

Params = Any


@checked_roles
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

    ROLES = StateRoles("anchor", advances=("count",))


def schedule(sync_every: int, count: int, tau: int) -> tuple[Transfer, ...]:
    """One transfer per fragment: applied after ``(p + 1) * H // P`` steps, sent ``tau``
    earlier. Needs ``0 <= tau < H // P`` so that each send comes after the previous apply."""
    return tuple(
        Transfer((p + 1) * sync_every // count - tau, (p + 1) * sync_every // count)
        for p in range(count)
    )


def streaming_diloco(
    outer_optimizer: optax.GradientTransformation,
    fragments: Fragments,
    sync_every: int,
    tau: int = 1,
    alpha: float = 0.5,
    *,
    axis_name: str = REPLICA,
    reduce: Reducer | None = None,
) -> OuterOptimizer:
    """Streaming DiLoCo with one ``outer_optimizer`` state per fragment.

    Args:
      outer_optimizer: the outer optax transform (the paper: Nesterov SGD, lr 0.4; see
        docs/algorithms/streaming_diloco.md; ``co2jax.outer_sgd(0.4, 0.9, nesterov=True)``).
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
      >>> [(t.send, t.apply) for t in outer.schedule]  # fragment 0: sent after step 1,
      [(1, 2), (3, 4)]
      >>> # applied after step 2; fragment 1: sent after step 3, applied after step 4
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
    reducer = as_reducer(reduce, axis_name)

    def init(params: Params) -> StreamingState:
        if jax.tree.structure(params) != fragments.treedef:
            raise ValueError("params do not have the tree structure the fragments were made for")
        states = tuple(outer_optimizer.init(fragments.take(params, p)) for p in range(count))
        return StreamingState(params, states, jnp.zeros([], jnp.int32))

    def send(params: Params, state: StreamingState, p: int):
        anchor, local = fragments.take(state.anchor, p), fragments.take(params, p)
        return [a - x for a, x in zip(anchor, local, strict=True)], state

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

    return OuterOptimizer(
        init, send, reducer, apply, schedule(sync_every, count, tau), period=sync_every
    )


@register("DiLoCo one fragment at a time, overlapped by tau steps")
@dataclasses.dataclass(frozen=True)
class StreamingDiLoCoSettings(Settings, OuterStep, Fragmented, Compression):
    """Streaming DiLoCo's settings: the outer transform, the fragments, compression."""

    algorithm: str = setting("streaming_diloco", "the algorithm")

    def build(self, context, reduce) -> OuterOptimizer:
        return streaming_diloco(
            self.transform(context), self.cut(context), context.sync_every, self.tau,
            self.alpha, reduce=reduce,
        )  # fmt: skip
