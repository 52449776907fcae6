"""A round as scan segments, with communication issued between segments and consumed later.

The inner steps of a round run as a few ``lax.scan`` segments (never unrolled per step). At a
boundary between segments an :class:`Issue` starts some communication from the current carry
(e.g. the reduction of a payload), and a later :class:`Consume` folds its result back into the
carry. Everything between the two is free to run concurrently with the communication, because
nothing in it depends on the issued value:

    Issue(at=0)      -> reduction of the previous round's payload (CO2, delayed DiLoCo)
    Consume(at=H)    -> the outer update

    Issue(at=t_p)    -> fragment p's pseudo-gradient (Streaming DiLoCo)
    Consume(at=t_p + tau) -> merge fragment p, tau inner steps later

The number of segments, not H, sets the program size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

Carry = Any


class Issue(NamedTuple):
    """At inner step ``at`` (before it runs), compute ``fn(carry)`` and keep it as ``name``."""

    at: int
    name: str
    fn: Callable[[Carry], Any]


class Consume(NamedTuple):
    """At inner step ``at`` (before it runs; ``at == H`` is after the last step), replace the
    carry by ``fn(carry, value)`` where ``value`` is what the :class:`Issue` ``name`` made."""

    at: int
    name: str
    fn: Callable[[Carry, Any], Carry]


def check_events(events: Sequence[Issue | Consume], steps: int) -> None:
    """Raises ``ValueError`` for events out of ``[0, steps]``, unmatched or out of order."""
    issued: dict[str, int] = {}
    for e in events:
        if not isinstance(e, (Issue, Consume)):
            raise ValueError(f"events must be Issue or Consume, got {e!r}")
        if isinstance(e.at, bool) or not isinstance(e.at, int) or not 0 <= e.at <= steps:
            raise ValueError(f"event {e.name!r} must have 0 <= at <= {steps}, got at={e.at!r}")
        if isinstance(e, Issue):
            if e.name in issued:
                raise ValueError(f"two Issue events are named {e.name!r}")
            issued[e.name] = e.at
        elif e.name not in issued or issued[e.name] > e.at:
            raise ValueError(f"Consume {e.name!r} at={e.at} has no earlier Issue of that name")
    consumed = {e.name for e in events if isinstance(e, Consume)}
    if set(issued) - consumed:
        raise ValueError(f"issued but never consumed: {sorted(set(issued) - consumed)}")


def scan_segments(
    step: Callable[[Carry, Any], tuple[Carry, Any]],
    carry: Carry,
    xs: Any,
    events: Sequence[Issue | Consume] = (),
) -> tuple[Carry, Any]:
    """``lax.scan(step, carry, xs)`` cut at the events' steps, running the events between.

    Events at the same step run in the order given. Returns the final carry and the stacked
    per-step outputs, exactly as one ``lax.scan`` would.

    Example:
      >>> import jax.numpy as jnp
      >>> step = lambda c, x: (c + x, c)
      >>> events = [Issue(1, "snap", lambda c: 10 * c), Consume(3, "snap", lambda c, v: c + v)]
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
    values: dict[str, Any] = {}
    outputs = []
    for start, stop in zip(cuts, [*cuts[1:], None], strict=True):
        for e in events:
            if e.at != start:
                continue
            if isinstance(e, Issue):
                values[e.name] = e.fn(carry)
            else:
                carry = e.fn(carry, values.pop(e.name))
        if stop is not None and stop > start:
            segment = jax.tree.map(lambda x, a=start, b=stop: x[a:b], xs)
            carry, ys = jax.lax.scan(step, carry, segment)
            outputs.append(ys)
    ys = jax.tree.map(lambda *parts: jnp.concatenate(parts), *outputs)
    return carry, ys
