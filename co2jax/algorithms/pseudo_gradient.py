"""The shared machinery: an optax transform stepping an anchor on (delayed) pseudo-gradients.

Every algorithm in :mod:`co2jax.algorithms` except ``data_parallel`` is this machinery with a
particular outer transform, delay and mixing rule. Per replica r and round t, with anchor
``theta^(t)`` and local parameters ``theta_r^(t,H)`` after the round's inner steps:

    Delta_r^(t)   = theta^(t) - theta_r^(t,H)                 (pseudo-gradient)
    g^(t)         = mean_r Delta_r^(t - d)                    (d = delay)
    eager only:   g_r^(t) = g^(t) + (Delta_r^(t) - Delta_r^(t - d)) / R
    theta^(t+1)   = theta^(t) + OuterOpt.update(g^(t), outer_state, theta^(t))

and every replica restarts round t+1 from ``theta^(t+1)``. While t < d no average has arrived
yet: the (non-eager) outer step is skipped outright, so the outer optimizer is stepped only on
real averages (a zero "gradient" would still advance Adam's count or apply weight decay).
Eager updates take a step from round 0, with ``Delta^(s) = 0`` for s < 0.

Because the mean is linear, reducing ``Delta_r`` rather than parameters is the same average
and needs no copy of the old anchor.

With d >= 1 the payload reduced at round t was produced at round t - d and is kept in
``pending``: it depends on the state only, so the schedule sends it before the round's first
inner step (:data:`co2jax.protocol.DELAYED`) and a driver hides its reduction behind them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from co2jax._checks import check_axis_name, check_int, check_transform
from co2jax.algorithms.fused import fusable_of
from co2jax.axes import REPLICA, axis_size
from co2jax.comm import policy
from co2jax.comm.reducer import Reducer, as_reducer, values
from co2jax.kernels.api import check_implementation, outer_update
from co2jax.protocol import DELAYED, SYNCHRONOUS, OuterOptimizer, Params, StateRoles, checked_roles
from co2jax.tree import tree_select, tree_size, tree_sub


@checked_roles
class PseudoGradientState(NamedTuple):
    """State of a pseudo-gradient outer optimizer (one per replica).

    Attributes:
      anchor: the global parameters every replica started the current round from.
        Replica-invariant (replica-varying for eager updates, whose anchor is replica-local).
        Same dtype as the parameters.
      outer_state: the outer optax transform's state, stepped once per sync.
        Replica-invariant (replica-varying for eager updates).
      pending: the replica's own pseudo-gradients of the last ``delay`` rounds, oldest first,
        not yet applied. Replica-varying. Empty when ``delay == 0``.
      count: 0-d int32, the number of syncs so far. Replica-invariant.
    """

    anchor: Params
    outer_state: optax.OptState
    pending: tuple[Params, ...]
    count: jax.Array

    ROLES = StateRoles("anchor", ("pending",), ("pending", "count"))


def pseudo_gradient_method(
    outer_optimizer: optax.GradientTransformation,
    *,
    delay: int = 0,
    eager: bool = False,
    num_replicas: int | None = None,
    axis_name: str = REPLICA,
    reduce: Reducer | None = None,
    implementation: str = "auto",
) -> OuterOptimizer:
    """Builds an outer optimizer that applies ``outer_optimizer`` to averaged pseudo-gradients.

    When ``outer_optimizer`` describes itself to the fused kernel (:func:`co2jax.outer_sgd`,
    CO2's momentum), the whole ``apply`` (pending payload, eager correction, penalty, momentum,
    clip, anchor) is one :func:`co2jax.kernels.outer_update`, which also takes the replicas'
    payloads un-reduced (:class:`co2jax.kernels.Gathered`, as the round engine's all-gather
    sends them) and averages them in the same pass. Any other optax transform runs as it is.

    Args:
      outer_optimizer: any optax transform; it receives the averaged pseudo-gradient as its
        "gradient" and the anchor as ``params``, and its updates are added to the anchor.
      delay: rounds between producing a pseudo-gradient and applying its average (0 = DiLoCo).
      eager: mix the replica's own current pseudo-gradient into the delayed average (eager
        updates); requires ``delay >= 1`` and makes the anchor and outer state replica-local.
      num_replicas: R for the eager mix; ``None`` reads the size of ``axis_name``.
      axis_name: the replica axis.
      reduce: the cross-replica reduction (a :class:`co2jax.comm.Reducer`, or a plain
        callable); defaults to the mean over ``axis_name``.
      implementation: for a fusable ``outer_optimizer``, the fused update's implementation:
        ``"auto"``, ``"pallas"``, ``"interpret"`` or ``"xla"`` (see :mod:`co2jax.kernels.api`).

    Returns:
      An :class:`~co2jax.OuterOptimizer` with :class:`PseudoGradientState`.
    """
    check_transform("outer_optimizer", outer_optimizer)
    delay = check_int("delay", delay, 0)
    check_axis_name("axis_name", axis_name)
    if eager and delay < 1:
        raise ValueError(f"eager updates need delay >= 1, got delay={delay!r}")
    if num_replicas is not None:
        num_replicas = check_int("num_replicas", num_replicas, 1)
    reducer = as_reducer(reduce, axis_name)
    check_implementation(implementation)
    fusable = fusable_of(outer_optimizer)
    if fusable is not None:
        reducer = policy.for_fused_update(reducer, implementation, axis_name)

    def init(params: Params) -> PseudoGradientState:
        pending = tuple(jax.tree.map(jnp.zeros_like, params) for _ in range(delay))
        count = jnp.zeros([], jnp.int32)
        return PseudoGradientState(params, outer_optimizer.init(params), pending, count)

    def send(params: Params, state: PseudoGradientState, i: int = 0):
        return (state.pending[0] if delay else tree_sub(state.anchor, params)), state

    def replicas() -> int:
        return num_replicas if num_replicas is not None else axis_size(axis_name)

    def apply_fused(params: Params, state: PseudoGradientState, reduced: Any):
        r = replicas() if eager else 0
        spec = dataclasses.replace(fusable.spec, delayed=bool(delay), eager_replicas=r)
        momentum, gap, gap_count = fusable.split(state.outer_state)
        applied = state.count >= delay if delay and not eager else jnp.bool_(True)
        correction = 1.0
        if gap is not None:
            correction = 1.0 - spec.gap_decay ** gap_count.astype(jnp.float32)
        out = outer_update(
            spec,
            reduced,
            state.anchor,
            momentum,
            params if delay else None,
            state.pending[0] if eager else None,
            gap,
            apply=applied,
            gap_correction=correction,
            implementation=implementation,
        )
        mean_penalty = out.penalty_sum / max(1, tree_size(state.anchor))
        outer_state = fusable.merge(
            state.outer_state, out.momentum, out.gap_scale, mean_penalty, applied
        )
        pending = (*state.pending[1:], out.pending) if delay else ()
        new_state = PseudoGradientState(out.anchor, outer_state, pending, state.count + 1)
        return out.anchor, new_state

    def apply(params: Params, state: PseudoGradientState, i: int, reduced: Any):
        if fusable is not None:
            return apply_fused(params, state, reduced)
        reduced = values(reduced)
        pending: tuple[Params, ...] = ()
        direction = reduced
        if delay:
            delta_now = tree_sub(state.anchor, params)
            pending = (*state.pending[1:], delta_now)
            if eager:
                r = replicas()
                direction = jax.tree.map(
                    lambda avg, now, old: avg + (now - old) / r,
                    reduced,
                    delta_now,
                    state.pending[0],
                )
        updates, outer_state = outer_optimizer.update(direction, state.outer_state, state.anchor)
        anchor = optax.apply_updates(state.anchor, updates)
        if delay and not eager:  # nothing has arrived during the first `delay` syncs
            arrived = state.count >= delay
            anchor = tree_select(arrived, anchor, state.anchor)
            outer_state = tree_select(arrived, outer_state, state.outer_state)
        new_state = PseudoGradientState(anchor, outer_state, pending, state.count + 1)
        return anchor, new_state

    return OuterOptimizer(
        init,
        send,
        reducer,
        apply,
        DELAYED if delay else SYNCHRONOUS,
        replica_local=eager,
        accepts_gathered=True,
        fused=fusable is not None,
    )
