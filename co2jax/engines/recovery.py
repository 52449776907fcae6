"""A poisoned replica restarts from the anchor.

A NaN or an Inf in one replica's batch (or a loss spike that overflows) makes its
parameters, its inner optimizer state (AdamW's moments) and its own outer memory
(error-feedback residuals, low-rank factors) non-finite. The reduction can leave its payload
out (``RoundTrainer(exclude_nonfinite=True)``, a weight of 0, a dropped job payload), and
every replica then applies the others' mean, but the replica itself would stay poisoned: its
next pseudo-gradient is NaN again and it is left out of every later round.

:func:`restart_poisoned` is what the engines run at a round's end. A replica is *poisoned*
when any element of its parameters, its inner state, or its own outer memory (the fields
its state type declares ``replica_varying`` that do not advance on every sync,
:class:`co2jax.protocol.StateRoles`) is not finite. A poisoned replica restarts as a fresh
one would, from the anchor every replica shares after the round:

    params  <- anchor
    inner   <- inner.init(anchor)
    memory  <- the field's value in outer.init(anchor)    (residuals: 0)

Its inner optimizer state is re-initialised, not restored from a last finite copy: a copy
would cost a second inner state in memory at every round for a rare event, and the moments
it would hold belong to parameters the replica no longer has (it restarts from the new
anchor, like a job that rejoins). A healthy replica's state is untouched, bit for bit.
Payloads in flight (a delayed algorithm's own pseudo-gradient, due in the next round's
reduction) are kept: that reduction leaves a non-finite one out (``exclude_nonfinite``, or
a weight of 0 in that round), so the lost round is the poisoned one.

Example:
  >>> import jax, jax.numpy as jnp, optax, co2jax
  >>> from co2jax.engines.recovery import restart_poisoned
  >>> inner, outer = optax.adam(0.1), co2jax.diloco(co2jax.outer_sgd(0.7))
  >>> anchor = {"w": jnp.ones(2)}
  >>> params = {"w": jnp.array([jnp.nan, 1.0])}
  >>> p, s, o = restart_poisoned(params, inner.init(params), outer.init(anchor),
  ...                            inner.init, outer.init)
  >>> p["w"], bool(jnp.all(jnp.isfinite(s[0].mu["w"])))
  (Array([1., 1.], dtype=float32), True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from co2jax.protocol import StateRoles, anchor_of, roles_of
from co2jax.tree import tree_all_finite, tree_select


def map_fields(state: Any, fresh: Any, chosen: Callable[[StateRoles, str], bool], fn) -> Any:
    """``state`` with ``fn(field, fresh_field)`` in place of every field ``chosen(roles,
    name)`` picks (by the roles its state type declares), at any depth; ``fresh`` is an
    ``init`` of the same structure."""
    if isinstance(state, tuple) and hasattr(type(state), "_fields"):
        roles = roles_of(state)
        fields = {
            name: fn(getattr(state, name), getattr(fresh, name))
            if chosen(roles, name)
            else map_fields(getattr(state, name), getattr(fresh, name), chosen, fn)
            for name in state._fields
        }
        return type(state)(**fields)
    if isinstance(state, list | tuple):
        return type(state)(map_fields(s, f, chosen, fn) for s, f in zip(state, fresh, strict=True))
    if isinstance(state, dict):
        return {k: map_fields(v, fresh[k], chosen, fn) for k, v in state.items()}
    return state


def own_memory(roles: StateRoles, name: str) -> bool:
    """A replica's own memory: replica-varying, not advanced on every sync (residuals and
    factors, not payloads in flight)."""
    return name in roles.replica_varying and name not in roles.advances


def memory_of(outer_state: Any) -> list:
    """The leaves of ``outer_state``'s own-memory fields (:func:`own_memory`)."""
    found: list = []
    map_fields(outer_state, outer_state, own_memory, lambda x, _: found.append(x) or x)
    return jax.tree.leaves(found)


def poisoned(params: Any, inner_state: Any, outer_state: Any) -> jax.Array:
    """0-d bool: some element of the replica's parameters, inner state or own outer memory
    is not finite."""
    return ~(
        tree_all_finite(params)
        & tree_all_finite(inner_state)
        & tree_all_finite(memory_of(outer_state))
    )


def restart_poisoned(
    params: Any,
    inner_state: Any,
    outer_state: Any,
    inner_init: Callable[[Any], Any],
    outer_init: Callable[[Any], Any],
) -> tuple[Any, Any, Any]:
    """``(params, inner_state, outer_state)`` of one replica, restarted from the anchor when
    :func:`poisoned` (see the module docstring), unchanged otherwise. An outer state without
    an anchor restarts the inner state (and memory) at the replica's own parameters."""
    bad = poisoned(params, inner_state, outer_state)
    anchor = anchor_of(outer_state)
    start = params
    if anchor is not None:
        start = jax.tree.map(lambda a, p: a.astype(p.dtype), anchor, params)
    params = tree_select(bad, start, params)
    inner_state = tree_select(bad, inner_init(start), inner_state)
    outer_state = map_fields(
        outer_state, outer_init(start), own_memory, lambda x, f: tree_select(bad, f, x)
    )
    return params, inner_state, outer_state
