"""The named mesh axes and the replica-axis lookup every collective goes through.

``REPLICA`` is the slow, outer axis (the only one outer optimizers communicate over);
``DATA`` and ``MODEL`` are the fast axes inside one replica.
"""

from __future__ import annotations

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
