"""The outer-optimizer protocol, replica reductions and argument validation.

An outer optimizer is what a replica runs once per round, after its H inner steps. Every sync is
split into three pure pieces so that the reduction can be swapped without touching the
algorithm::

    payload = outer.payload(params, state)        # local: what this replica puts on the wire
    reduced = outer.reduce(payload)               # collective over the replica axis
    params, state = outer.apply(params, state, reduced)   # local: the outer update

``outer.sync(params, state)`` is exactly that composition. Inside one SPMD program the reduce is
a named-axis mean (``lax.pmean``), so the same algorithm runs under
``jax.vmap(..., axis_name="replica")`` on one device and under ``jax.shard_map`` on a mesh. A
driver that runs each replica as its own job calls ``payload`` and ``apply`` itself and moves
the payloads between jobs in its own way.

``staleness`` says how many rounds old the payload is: 0 means it is computed from the current
parameters; k >= 1 means it depends on the state only (it was computed k rounds ago), so its
reduction can be issued before, and overlap with, the round's inner steps.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

Params = Any
State = Any
Payload = Any
Reducer = Callable[[Payload], Payload]
"""A function from this replica's payload pytree to the replicas' reduced payload pytree."""

REPLICA_AXIS = "replica"


class OuterOptimizer(NamedTuple):
    """An outer-optimizer algorithm as a tuple of pure functions.

    Attributes:
      init: ``init(params) -> state``, called per replica with that replica's parameters (all
        replicas start from the same parameters). Each state type documents which of its
        fields are replica-varying and which are replica-invariant.
      sync: ``sync(params, state) -> (new_params, new_state)``, called once per round by every
        replica, after its inner steps, with its local parameters; returns the parameters the
        replica starts the next round from. Equal to ``apply(params, state,
        reduce(payload(params, state)))``.
      payload: ``payload(params, state) -> payload``: the local pytree this replica
        contributes to the reduction at this sync.
      reduce: ``reduce(payload) -> reduced``: the cross-replica reduction (by default the
        mean over ``axis_name``). The only piece that communicates.
      apply: ``apply(params, state, reduced) -> (new_params, new_state)``: the local outer
        update from the reduced payload.
      staleness: 0 when the payload is computed from the current parameters; k >= 1 when it
        was computed k rounds earlier and depends on ``state`` only.
      replica_local: True when the anchor and outer state differ between replicas (eager
        updates), so a driver must keep them replica-varying; False when they are
        replica-invariant and may be stored once per replica group.
      accepts_gathered: True when ``apply`` also takes the replicas' payloads un-reduced, as
        :class:`co2jax.kernels.Gathered` (an all-gather that the fused outer update averages
        in its own pass); a driver may then skip the separate mean.
    """

    init: Callable[[Params], State]
    sync: Callable[[Params, State], tuple[Params, State]]
    payload: Callable[[Params, State], Payload]
    reduce: Reducer
    apply: Callable[[Params, State, Payload], tuple[Params, State]]
    staleness: int = 0
    replica_local: bool = False
    accepts_gathered: bool = False


def make_outer_optimizer(
    init: Callable[[Params], State],
    payload: Callable[[Params, State], Payload],
    apply: Callable[[Params, State, Payload], tuple[Params, State]],
    reduce: Reducer,
    staleness: int = 0,
    replica_local: bool = False,
    accepts_gathered: bool = False,
) -> OuterOptimizer:
    """Builds an :class:`OuterOptimizer` whose ``sync`` is ``apply . reduce . payload``."""

    def sync(params: Params, state: State) -> tuple[Params, State]:
        return apply(params, state, reduce(payload(params, state)))

    return OuterOptimizer(
        init, sync, payload, reduce, apply, staleness, replica_local, accepts_gathered
    )


def check_axis(axis_name: str) -> int:
    """Returns the size of ``axis_name``; raises a helpful error when it is not bound."""
    try:
        return jax.lax.axis_size(axis_name)
    except NameError as e:
        raise NameError(
            f"co2jax: the replica axis {axis_name!r} is not bound here. Outer optimizers "
            "communicate by axis name: run the sync under "
            f"jax.vmap(fn, axis_name={axis_name!r}) to simulate replicas on one device, or "
            f"under jax.shard_map over a mesh that has an axis named {axis_name!r}."
        ) from e


def replica_mean(axis_name: str = REPLICA_AXIS) -> Reducer:
    """The default reduction: the element-wise mean of the payload over ``axis_name``.

    Outside a bound ``axis_name`` it raises a ``NameError`` that says how to run it.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> mean = replica_mean("replica")
      >>> jax.vmap(mean, axis_name="replica")(jnp.array([1.0, 3.0]))
      Array([2., 2.], dtype=float32)
    """

    check_axis_name("axis_name", axis_name)

    def reduce(payload: Payload) -> Payload:
        check_axis(axis_name)
        return jax.tree.map(lambda x: jax.lax.pmean(x, axis_name), payload)

    return reduce


# ---------------------------------------------------------------------------------------------
# Pytree arithmetic shared by the algorithms.


def tree_sub(a: Params, b: Params) -> Params:
    return jax.tree.map(lambda x, y: x - y, a, b)


def tree_all_finite(tree: Any) -> jax.Array:
    """A 0-d bool: True when every element of every leaf is finite."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.array(True)
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]).all()


def tree_select(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    return jax.tree.map(lambda t, f: jnp.where(pred, t, f), on_true, on_false)


# ---------------------------------------------------------------------------------------------
# Eager validation: every factory checks its hyper-parameters before anything is traced.


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_positive(name: str, value: Any) -> float:
    if not _is_real(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {name}={value!r}")
    return float(value)


def check_unit_interval(name: str, value: Any, *, closed_right: bool = False) -> float:
    ok = _is_real(value) and 0 <= value and (value <= 1 if closed_right else value < 1)
    if not ok:
        bound = "[0, 1]" if closed_right else "[0, 1)"
        raise ValueError(f"{name} must be a number in {bound}, got {name}={value!r}")
    return float(value)


def check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {name}={value!r}")
    return int(value)


def check_axis_name(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {name}={value!r}")
    return value


def check_transform(name: str, value: Any) -> optax.GradientTransformation:
    if not (hasattr(value, "init") and hasattr(value, "update")):
        raise ValueError(
            f"{name} must be an optax GradientTransformation (with init and update), "
            f"got {name}={value!r}"
        )
    return value
