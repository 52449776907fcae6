"""A round as scan segments, with actions run at the boundaries between them.

The inner steps of a round run as a few ``lax.scan`` segments (never unrolled per step). At
the boundary before step ``at`` (``at == steps``: after the last one) an :class:`Event` runs
on the carry; it may keep values in the round's ``store`` (a dict) for a later event, e.g.
a reduction issued at one boundary and consumed at a later one. Everything between the two is
free to run concurrently with the communication, because nothing in it depends on the issued
value. The number of segments, not H, sets the program size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

Carry = Any


class Event(NamedTuple):
    """At the boundary before step ``at``, ``carry = fn(carry, store)`` (``store``: the
    round's dict of in-flight values, shared by its events)."""

    at: int
    fn: Callable[[Carry, dict], Carry]


def check_events(events: Sequence[Event], steps: int) -> None:
    """Raises ``ValueError`` for an event that is not an :class:`Event` or is out of
    ``[0, steps]``."""
    for e in events:
        if not isinstance(e, Event):
            raise ValueError(f"events must be co2jax.engines.segments.Event, got {e!r}")
        if isinstance(e.at, bool) or not isinstance(e.at, int) or not 0 <= e.at <= steps:
            raise ValueError(f"an event must have 0 <= at <= {steps}, got at={e.at!r}")


def scan_segments(
    step: Callable[[Carry, Any], tuple[Carry, Any]],
    carry: Carry,
    xs: Any,
    events: Sequence[Event] = (),
) -> tuple[Carry, Any]:
    """``lax.scan(step, carry, xs)`` cut at the events' steps, running the events between.

    Events at the same boundary run in the order given. Returns the final carry and the
    stacked per-step outputs, exactly as one ``lax.scan`` would.

    Example:
      >>> import jax.numpy as jnp
      >>> step = lambda c, x: (c + x, c)
      >>> def snap(c, store):
      ...     store["snap"] = 10 * c
      ...     return c
      >>> events = [Event(1, snap), Event(3, lambda c, store: c + store.pop("snap"))]
      >>> carry, ys = scan_segments(step, jnp.float32(0), jnp.arange(4.0), events)
      >>> float(carry), ys.tolist()   # snap = 10 * 0 after step 0; added before step 3
      (6.0, [0.0, 0.0, 1.0, 3.0])
    """
    leaves = jax.tree.leaves(xs)
    if not leaves:
        raise ValueError("scan_segments needs xs with at least one leaf")
    steps = leaves[0].shape[0]
    events = list(events)
    check_events(events, steps)
    cuts = sorted({0, steps, *(e.at for e in events)})
    store: dict = {}
    outputs = []
    for start, stop in zip(cuts, [*cuts[1:], None], strict=True):
        for e in events:
            if e.at == start:
                carry = e.fn(carry, store)
        if stop is not None and stop > start:
            segment = jax.tree.map(lambda x, a=start, b=stop: x[a:b], xs)
            carry, ys = jax.lax.scan(step, carry, segment)
            outputs.append(ys)
    ys = jax.tree.map(lambda *parts: jnp.concatenate(parts), *outputs)
    return carry, ys
