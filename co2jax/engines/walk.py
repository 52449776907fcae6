"""One walk of an outer optimizer's schedule, for every driver.

A round's schedule (:func:`co2jax.protocol.plan`) is cut into *segments* of inner steps at
every step where a transfer is sent or applied, or where its chunks start or stop (a delayed
or synchronous algorithm: one segment). At the boundary before each segment a driver runs the
actions due there in the plan's order (the transfers applied there, then those sent there);
inside a segment, a transfer in chunks reduces one chunk before each step. Every driver runs
this one walk (:func:`run`) and supplies only how it does four things (:class:`Driver`):

- ``send(carry, i)``: take transfer i's payload; one in a single piece starts its reduction
  here, one in chunks is held for its chunks;
- ``chunk(carry, i, c)``: reduce chunk c (a Python int, or a traced step index);
- ``apply(carry, i)``: finish transfer i's reduction and apply it;
- ``segment(carry, segment)``: run inner steps ``[start, stop)``, with the chunks due in
  them.

The round engine runs a segment as one ``lax.scan`` with its chunks inside the steps; the
per-step adapter is one step at a time (:meth:`Walk.before` and :meth:`Walk.after` say what
runs before and after step k); separate jobs publish each chunk at a boundary of its own
(``chunks_in_steps=False``); the cost model prices the same walk (:func:`round_seconds`).

Example:
  >>> from co2jax.protocol import Transfer
  >>> w = walk((Transfer(0, 4, chunks=2),), 4)
  >>> [(s.start, s.stop, [a.kind for a in s.actions], s.chunked) for s in w.segments]
  [(0, 2, ['send'], (0,)), (2, 4, [], ())]
  >>> [a.kind for a in w.end]
  ['apply']
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple, Protocol

from co2jax.protocol import Action, Transfer, act, action_key, plan


class Segment(NamedTuple):
    """Inner steps ``[start, stop)`` and what precedes them.

    Attributes:
      start, stop: the steps.
      actions: the actions at the boundary before step ``start``, in plan order.
      chunked: transfers that reduce a chunk before every step of the segment (chunk
        ``k - send`` before step k).
    """

    start: int
    stop: int
    actions: tuple[Action, ...]
    chunked: tuple[int, ...] = ()


class Walk(NamedTuple):
    """A round's schedule as segments (:func:`walk`).

    Attributes:
      steps: H.
      transfers: the resolved transfers (chunks included).
      segments: the segments, in order, covering steps ``[0, H)``.
      end: the actions after the last step.
    """

    steps: int
    transfers: tuple[Transfer, ...]
    segments: tuple[Segment, ...]
    end: tuple[Action, ...]

    def at(self, b: int) -> tuple[Action, ...]:
        """The actions at boundary ``b`` (before step b; ``b == H``: after the last)."""
        if b == self.steps:
            return self.end
        return next((s.actions for s in self.segments if s.start == b), ())

    def before(self, k: int) -> tuple[Action, ...]:
        """What runs before step ``k`` when steps run one at a time: the sends (and a
        boundary's own chunks) at boundary k."""
        return tuple(a for a in self.at(k) if a.kind in ("send", "chunk"))

    def after(self, k: int) -> tuple[Action, ...]:
        """What runs after step ``k`` when steps run one at a time: the transfers applied at
        boundary k + 1 (one sent there too is sent there first)."""
        return tuple(a for a in self.at(k + 1) if a.kind in ("sync", "apply"))


def walk(transfers: tuple[Transfer, ...], steps: int, chunks_in_steps: bool = True) -> Walk:
    """``transfers`` (resolved: :func:`co2jax.protocol.resolve`) for rounds of ``steps``
    inner steps, as segments. ``chunks_in_steps``: a transfer's chunks are reduced inside
    the steps of the segments they span (one per step); otherwise each chunk is an action
    at the boundary before its step (chunk 0 right after the send)."""
    actions = plan(transfers)
    cuts = {0, steps}
    for t in transfers:
        cuts |= {t.send, t.apply}
        if t.chunks > 1:
            cuts.add(min(steps, t.send + t.chunks))
            if not chunks_in_steps:
                cuts |= {t.send + c for c in range(t.chunks)}
    cuts = sorted(cuts)
    by_step: dict[int, list[Action]] = {}
    for a in actions:
        if a.kind == "chunk" and chunks_in_steps:
            continue
        by_step.setdefault(a.at, []).append(a)
        if a.kind == "send" and transfers[a.transfer].chunks > 1 and not chunks_in_steps:
            by_step[a.at].append(Action(a.at, "chunk", a.transfer, 0))
    segments = []
    for start, stop in itertools.pairwise(cuts):
        chunked = ()
        if chunks_in_steps:
            chunked = tuple(
                i
                for i, t in enumerate(transfers)
                if t.chunks > 1 and t.send != t.apply and t.send <= start < t.send + t.chunks
            )
        segments.append(Segment(start, stop, tuple(_ordered(by_step.get(start, []))), chunked))
    return Walk(steps, tuple(transfers), tuple(segments), tuple(_ordered(by_step.get(steps, []))))


def _ordered(actions: list[Action]) -> list[Action]:
    return sorted(actions, key=action_key)


class Driver(Protocol):
    """What a driver supplies to :func:`run` (see the module docstring)."""

    def send(self, carry: Any, i: int) -> Any: ...

    def chunk(self, carry: Any, i: int, c: Any) -> Any: ...

    def apply(self, carry: Any, i: int) -> Any: ...

    def segment(self, carry: Any, segment: Segment) -> Any: ...


def run(w: Walk, driver: Driver, carry: Any) -> Any:
    """The whole round: each segment's boundary actions then its steps, then the end's."""
    for segment in w.segments:
        carry = act(driver, carry, segment.actions)
        carry = driver.segment(carry, segment)
    return act(driver, carry, w.end)


def round_seconds(w: Walk, step_s: float, transfer_s: list[float], slowdown: float = 0.0) -> float:
    """The seconds of one round of ``w`` (the cost model's): H inner steps of ``step_s``
    each, and per transfer i of ``transfer_s[i]`` seconds on the link, hidden behind the
    inner steps between its send and its apply, up to their compute (the hidden time slows
    that compute by ``slowdown``, a fraction), the rest waited for at its apply:

    .. math::

        T = H s + \\sum_i \\left(\\sigma h_i + c_i - h_i\\right), \\qquad
        h_i = \\min(c_i, (\\mathrm{apply}_i - \\mathrm{send}_i)\\, s)

    Transfers are priced one by one (two whose spans overlap do not share the link).

    Example:
      >>> from co2jax.protocol import Transfer
      >>> sync, delayed = walk((Transfer(4, 4),), 4), walk((Transfer(0, 4),), 4)
      >>> round_seconds(sync, 1.0, [3.0]), round_seconds(delayed, 1.0, [3.0])
      (7.0, 4.0)
    """
    total = w.steps * step_s
    for t, seconds in zip(w.transfers, transfer_s, strict=True):
        hidden = min(seconds, (t.apply - t.send) * step_s)
        total += slowdown * hidden + seconds - hidden
    return total
