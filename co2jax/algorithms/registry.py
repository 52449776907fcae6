"""The algorithm registry, in one module: every algorithm's class by name, its settings made
from a config, and what each can do, derived.

An algorithm is one class (:class:`co2jax.algorithms.settings.Settings`): a frozen
dataclass of the shared pieces it takes and its own fields, its ``check``, what it builds
for the outer side (``build``; :meth:`~Settings.outer` adds the compressed reducer, the
guard and error feedback) and the inner side (:meth:`~Settings.inner`), its bytes
(:meth:`~Settings.step_bytes`) and what a run records of it (``metrics``). One decorator
registers it here (:func:`register`); importing ``co2jax.algorithms`` imports every
algorithm module, so :data:`REGISTRY` holds them all (this module imports none of them: each
imports :func:`register` from here). :func:`settings` makes an algorithm's object from a
config's fields; ``NAMES`` lists them in report order. Adding an algorithm is its file, its
textbook loop (``tests/textbook.py``), its docs page and its import in
``co2jax/algorithms/__init__.py``; the experiment configs, the comparison report and the
shared tests read it from here. What an algorithm can do (:func:`capabilities`) is derived
from what it builds, not declared.

Example:
  >>> s = settings("co2", learning_rate=1.0, momentum=0.5)
  >>> outer = s.validate().outer(Context(sync_every=8))
  >>> capabilities("co2").delayed, outer.overlapped
  (True, True)
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from co2jax.algorithms.settings import (
    COLLECTIVES,
    COMPRESSIONS,
    Bounds,
    Compression,
    Context,
    Fragmented,
    Guard,
    OuterStep,
    Settings,
    fail,
)
from co2jax.axes import REPLICA, communicates
from co2jax.protocol import resolve

REGISTRY: dict[str, type[Settings]] = {}


def register(summary: str):
    """Registers an algorithm's class under the default of its ``algorithm`` field, with a
    one-line ``summary`` (``--help`` lists it), and stamps the class with its name
    (:meth:`Settings.validate` checks that a settings object is its algorithm's own class).
    Everything else the algorithm is, the class says: its fields, its ``check``, what it
    builds for each side (:meth:`Settings.build`, :meth:`Settings.inner`), its bytes."""

    def wrap(cls: type) -> type:
        name = next(f.default for f in dataclasses.fields(cls) if f.name == "algorithm")
        if not name or name in REGISTRY:
            raise ValueError(f"{cls.__name__}: algorithm={name!r} is empty or taken")
        REGISTRY[name] = cls
        cls.registered_as, cls.summary = name, summary
        return cls

    return wrap


ORDER = (
    "ddp",
    "local_sgd",
    "slowmo",
    "diloco",
    "delayed_diloco",
    "eager_diloco",
    "co2",
    "streaming_diloco",
    "sparseloco",
    "dct_diloco",
    "demo",
    "cocodc",
    "diloco_x",
    "noloco",
    "hierarchical_diloco",
    "sparta",
    "sparta_diloco",
    "desloc",
    "muloco",
)


def _names() -> tuple[str, ...]:
    return (*(n for n in ORDER if n in REGISTRY), *(n for n in REGISTRY if n not in ORDER))


def __getattr__(name: str) -> Any:
    """``NAMES``: every registered algorithm, in the order the reports list them (one not in
    ``ORDER`` after those, in the order it registered), read when asked for: the algorithm
    modules register themselves when ``co2jax.algorithms`` imports them, after this
    module (each imports :func:`register` from here, so this one imports none of them)."""
    if name == "NAMES":
        return _names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "COLLECTIVES",
    "COMPRESSIONS",
    "REGISTRY",
    "Bounds",
    "Capabilities",
    "Context",
    "Settings",
    "capabilities",
    "settings",
    "register",
    "unknown",
]


def settings(algorithm: str, **fields: Any) -> Settings:
    """``algorithm``'s settings with ``fields`` set (not yet validated). A field the
    algorithm does not declare raises a one-line ``ValueError`` naming ``outer.<field>``."""
    if algorithm not in REGISTRY:
        fail("algorithm", algorithm, f"must be one of {_names()}")
    cls = REGISTRY[algorithm]
    names = {f.name for f in dataclasses.fields(cls)}
    for name, value in fields.items():
        if name not in names:
            fail(name, value, unknown(algorithm, name))
    return cls(**fields)


def unknown(algorithm: str, name: str) -> str:
    """Why ``name`` cannot be set for ``algorithm`` (it declares no such setting), one line:
    the algorithms that have it, or the nearest of its own."""
    every = _names()
    owners = [n for n in every if name in {f.name for f in dataclasses.fields(REGISTRY[n])}]
    if owners:
        return f"{algorithm} has no such setting (a setting of {', '.join(owners)})"
    names = [f.name for f in dataclasses.fields(REGISTRY[algorithm])]
    near = difflib.get_close_matches(name, names, n=1)
    hint = f"; did you mean outer.{near[0]}?" if near else ""
    return f"{algorithm} has no such setting{hint} (its settings: {', '.join(names)})"


class Capabilities(NamedTuple):
    """What an algorithm does with its default settings, derived from what it builds
    (:func:`capabilities`).

    Attributes:
      delayed: sends a payload before the round's inner steps and applies it after them.
      fusable: its outer step runs as the fused Pallas kernel on the replicas' gathered
        payloads (a fused update behind an exact mean).
      compressible: takes ``compression`` (its settings have the piece).
      fragments: syncs parameter fragments, one transfer each.
      every_step: its inner transform communicates over the replica axis every step.
      guardable: ``skip_nonfinite`` guards it (its settings have the piece).
      outer_transform: its outer step is an optax transform of the averaged pseudo-gradient.
      gossip: its reducer reaches a group of replicas only.
    """

    delayed: bool
    fusable: bool
    compressible: bool
    fragments: bool
    every_step: bool
    guardable: bool
    outer_transform: bool
    gossip: bool


H = 8  # the round length the capabilities are read at (any H an algorithm takes)


@functools.cache
def capabilities(algorithm: str) -> Capabilities:
    """What ``algorithm`` does, read off the optimizer it builds with default settings on
    stand-in parameters (one leaf per fragment) and off its inner transform (traced)."""
    s = settings(algorithm)
    leaves = {f"layer{i}": jax.ShapeDtypeStruct((8,), jnp.float32) for i in range(4)}
    context = Context(H, leaves, 0.1, num_replicas=2)
    wrapped, outer = s.optimizers(context, optax.sgd(0.1, momentum=0.9))  # with a moment
    transfers = resolve(outer, H)
    state = jax.eval_shape(wrapped.init, leaves)
    step = lambda g, st, p: wrapped.update(g, st, p)[0]
    return Capabilities(
        delayed=any(t.send == 0 and t.apply == H for t in transfers),
        fusable=outer.fused and outer.reducer.exact,
        compressible=isinstance(s, Compression),
        fragments=isinstance(s, Fragmented) and len(transfers) > 1,
        every_step=communicates(step, (leaves, state, leaves), REPLICA),
        guardable=isinstance(s, Guard),
        outer_transform=isinstance(s, OuterStep),
        gossip=outer.reducer.reach == "group",
    )


def names_where(flag: str) -> tuple[str, ...]:
    """The registered algorithms whose capability ``flag`` is true."""
    return tuple(n for n in _names() if getattr(capabilities(n), flag))
