"""Structural overlap checks: does a replica-axis collective depend on, or feed, the inner loop?

XLA:CPU runs collectives synchronously, so on CPU overlap can only be shown structurally: in
the traced program, a delayed round's reduction over ``replica`` must neither consume an
output of the inner loop nor produce an input of it. Then an asynchronous collective (see
``docs/overlap.md`` for which forms a compiler overlaps) is free to run while the loop runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax.extend.core import Literal

from co2jax.axes import COLLECTIVES
from co2jax.mesh import REPLICA

LOOPS = frozenset({"scan", "while"})


class OverlapReport(NamedTuple):
    """What :func:`overlap_report` found in the program's innermost loop-holding jaxpr.

    Attributes:
      collectives: replica-axis collectives beside the loop (not inside it).
      in_loop: replica-axis collectives inside a loop (inner steps must have none).
      loops: loops found beside the collectives.
      after_loop: collectives that consume (transitively) an output of a loop.
      before_loop: collectives whose results feed (transitively) an input of a loop.
    """

    collectives: int
    in_loop: int
    loops: int
    after_loop: int
    before_loop: int

    @property
    def independent(self) -> bool:
        """True when every replica collective can run concurrently with the loop."""
        return self.collectives > 0 and self.after_loop == 0 and self.before_loop == 0


def _subjaxprs(eqn) -> list:
    out = []
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(v, "eqns"):
                out.append(v)
            elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
                out.append(v.jaxpr)
    return out


def _axes(eqn) -> tuple:
    axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
    return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


def _count(jaxpr, axis: str, inside_loop: bool = False) -> tuple[int, int, int]:
    """(collectives over axis outside loops, inside loops, loops) in ``jaxpr``, recursively."""
    outside = inside = loops = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in COLLECTIVES and axis in _axes(eqn):
            if inside_loop:
                inside += 1
            else:
                outside += 1
        is_loop = name in LOOPS
        loops += is_loop
        for sub in _subjaxprs(eqn):
            o, i, n = _count(sub, axis, inside_loop or is_loop)
            outside, inside, loops = outside + o, inside + i, loops + n
    return outside, inside, loops


def _loop_level(jaxpr):
    """The jaxpr whose own equations include a loop (descending through calls)."""
    if any(e.primitive.name in LOOPS for e in jaxpr.eqns):
        return jaxpr
    for eqn in jaxpr.eqns:
        for sub in _subjaxprs(eqn):
            found = _loop_level(sub)
            if found is not None:
                return found
    return None


def _tainted(jaxpr, sources: set) -> set:
    """Vars of ``jaxpr`` that depend on the outputs of the equations in ``sources``."""
    tainted: set = set()
    for i, eqn in enumerate(jaxpr.eqns):
        hit = i in sources or any(not isinstance(v, Literal) and v in tainted for v in eqn.invars)
        if hit:
            tainted.update(eqn.outvars)
    return tainted


def overlap_report(fn: Callable, *args: Any, axis: str = REPLICA) -> OverlapReport:
    """Traces ``fn(*args)`` and reports how its ``axis`` collectives relate to its loop.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> def f(x, pending):
      ...     reduced = jax.lax.psum(pending, "replica")          # independent of the loop
      ...     x = jax.lax.fori_loop(0, 3, lambda i, x: x * 2.0, x)
      ...     return x + reduced
      >>> from jax.sharding import AxisType, PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("replica",), axis_types=(AxisType.Auto,),
      ...                      devices=jax.devices()[:1])
      >>> g = jax.shard_map(f, mesh=mesh, in_specs=P("replica"), out_specs=P("replica"))
      >>> overlap_report(g, jnp.ones(2), jnp.ones(2))
      OverlapReport(collectives=1, in_loop=0, loops=1, after_loop=0, before_loop=0)

    Under ``jax.vmap`` a named-axis collective becomes an ordinary reduction, so check
    ``shard_map`` programs.
    """
    closed = jax.make_jaxpr(fn)(*args)
    outside, inside, _ = _count(closed.jaxpr, axis)
    level = _loop_level(closed.jaxpr)
    if level is None:
        return OverlapReport(outside, inside, 0, 0, 0)
    loops = {i for i, e in enumerate(level.eqns) if e.primitive.name in LOOPS}
    holders = {i for i, e in enumerate(level.eqns) if i not in loops and _count_eqn(e, axis)}
    after_loop_vars = _tainted(level, loops)
    after = sum(
        any(not isinstance(v, Literal) and v in after_loop_vars for v in level.eqns[i].invars)
        for i in holders
    )
    after_coll_vars = _tainted(level, holders)
    before = sum(
        any(not isinstance(v, Literal) and v in after_coll_vars for v in level.eqns[i].invars)
        for i in loops
    )
    in_loop = sum(_count(s, axis, True)[1] for i in loops for s in _subjaxprs(level.eqns[i]))
    return OverlapReport(outside, inside, len(loops), after, before)._replace(
        in_loop=max(inside, in_loop)
    )


def _count_eqn(eqn, axis: str) -> int:
    own = int(eqn.primitive.name in COLLECTIVES and axis in _axes(eqn))
    return own + sum(_count(s, axis)[0] for s in _subjaxprs(eqn))


_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "shard_map", "remat", "checkpoint"})


def _taint(jaxpr, tainted_in: list[bool], axis: str) -> tuple[list[bool], int, int]:
    """Propagates "depends on the sources" through ``jaxpr``; counts ``axis`` collectives.

    Returns the taint of the outputs, the number of collectives, and how many of them have a
    tainted input. Call-like equations are entered positionally; any other equation with a
    sub-program is treated as a whole (a tainted input taints everything inside it).
    """
    tainted = {v for v, t in zip(jaxpr.invars, tainted_in, strict=True) if t}
    total = hit = 0
    for eqn in jaxpr.eqns:
        flags = [not isinstance(v, Literal) and v in tainted for v in eqn.invars]
        subs = _subjaxprs(eqn)
        if eqn.primitive.name in _CALLS and len(subs) == 1 and len(subs[0].invars) == len(flags):
            out_flags, n, k = _taint(subs[0], flags, axis)
        else:
            n = _count_eqn(eqn, axis)
            k = n if any(flags) else 0
            out_flags = [any(flags)] * len(eqn.outvars)
        total, hit = total + n, hit + k
        tainted.update(v for v, t in zip(eqn.outvars, out_flags, strict=True) if t)
    return [not isinstance(v, Literal) and v in tainted for v in jaxpr.outvars], total, hit


def collectives_depending_on(
    fn: Callable, *args: Any, argnums: tuple[int, ...] = (0,), axis: str = REPLICA
) -> tuple[int, int]:
    """``(n, k)``: the ``axis`` collectives in ``fn(*args)``, and how many of them depend
    (transitively) on the arguments ``argnums``.

    ``k == 0`` means the communication can be issued without waiting for those arguments, e.g.
    a per-step reduction that does not wait for the step's gradients. Trace a ``shard_map``
    program: under ``vmap`` named-axis collectives become ordinary reductions.
    """
    closed = jax.make_jaxpr(fn)(*args)
    flags = [i in argnums for i, a in enumerate(args) for _ in jax.tree.leaves(a)]
    _, total, hit = _taint(closed.jaxpr, flags, axis)
    return total, hit
