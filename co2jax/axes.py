"""The named mesh axes and the replica-axis lookup every collective goes through.

``REPLICA`` is the slow, outer axis (the only one outer optimizers communicate over);
``DATA`` and ``MODEL`` are the fast axes inside one replica.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

REPLICA = "replica"
DATA = "data"
MODEL = "model"
AXES = (REPLICA, DATA, MODEL)

COLLECTIVES = frozenset(
    {
        "psum",
        "psum_invariant",
        "pmax",
        "pmin",
        "all_gather",
        "all_gather_invariant",
        "ppermute",
        "psum_scatter",
        "reduce_scatter",
        "all_to_all",
        "ragged_all_to_all",
    }
)
"""The primitives that communicate over a named axis (what the tools and the drivers count)."""


def axis_size(axis_name: str) -> int:
    """The size of ``axis_name``; a ``NameError`` that says how to bind it when it is not."""
    try:
        return jax.lax.axis_size(axis_name)
    except NameError as e:
        raise NameError(
            f"co2jax: the replica axis {axis_name!r} is not bound here. Outer optimizers "
            "communicate by axis name: run the sync under "
            f"jax.vmap(fn, axis_name={axis_name!r}) to simulate replicas on one device, or "
            f"under jax.shard_map over a mesh that has an axis named {axis_name!r}."
        ) from e


def bound_axis_size(axis_name: str) -> int | None:
    """The size of ``axis_name``, or ``None`` outside any binding of it (a separate job)."""
    try:
        return jax.lax.axis_size(axis_name)
    except NameError:
        return None


def collectives_in(jaxpr: Any, axis: str) -> int:
    """How many collectives over ``axis`` a traced program holds (sub-programs included)."""
    found = 0
    for eqn in jaxpr.eqns:
        names = eqn.params.get("axes", eqn.params.get("axis_name", ()))
        names = names if isinstance(names, tuple | list) else (names,)
        found += axis in names and eqn.primitive.name in COLLECTIVES
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += collectives_in(inner, axis)
    return found


def communicates(fn: Callable, args: tuple, axis: str = "replica", size: int = 2) -> bool:
    """Whether ``fn(*args)`` (arrays or ShapeDtypeStructs) communicates over ``axis`` when
    that axis is bound with ``size`` members (traced, nothing run)."""
    closed = jax.make_jaxpr(fn, axis_env=[(axis, size)])(*args)
    return collectives_in(closed.jaxpr, axis) > 0
