"""Parameter fragments for Streaming DiLoCo: which pieces of a pytree sync together.

A :class:`Fragments` splits a params pytree into P fragments. The unit is a *piece*: a whole
leaf, or, for a leaf whose leading axis stacks layers (``stacked=`` path patterns), one layer
slice of it. Every element of every leaf belongs to exactly one fragment.

Strategies over the ordered list of layers (stacked slices in layer order, then any other
leaf matched by ``layer_of``):

- ``"strided"`` (the paper's preferred): layer i goes to fragment ``i mod P``, so every
  fragment spans the whole depth;
- ``"sequential"``: consecutive blocks of layers;
- ``patterns``: fragment p is every leaf whose path matches ``patterns[p]`` (a regex).

Leaves that are not layers (embeddings, the head, final norms) go to the fragment given by
``assign`` (``{pattern: fragment}``), else to fragment 0.

Example:
  >>> import jax.numpy as jnp
  >>> params = {"embed": jnp.zeros(4), "layers": {"w": jnp.zeros((4, 2, 2))}}
  >>> frags = make_fragments(params, 2, stacked=r"layers")
  >>> [[(f.path, f.index) for f in frag] for frag in frags.fragments]
  [[('embed', None), ('layers/w', (0, 2))], [('layers/w', (1, 3))]]
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import numpy as np

from co2jax._checks import check_int

STRATEGIES = ("strided", "sequential")


@dataclasses.dataclass(frozen=True)
class Piece:
    """Part of one leaf: the whole leaf (``index is None``) or layer slices along axis 0."""

    leaf: int
    path: str
    index: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Fragments:
    """A partition of a pytree's leaves (and layer slices) into fragments (static)."""

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    fragments: tuple[tuple[Piece, ...], ...]

    @property
    def count(self) -> int:
        return len(self.fragments)

    def take(self, tree: Any, p: int) -> list[jax.Array]:
        """Fragment ``p``'s pieces of ``tree`` (a list of arrays, one per piece)."""
        leaves = jax.tree.leaves(tree)
        return [
            leaves[q.leaf] if q.index is None else self._layers(leaves[q.leaf], q)
            for q in self.fragments[p]
        ]

    def _layers(self, x: jax.Array, q: Piece) -> jax.Array:
        if x.shape[0] != self.shapes[q.leaf][0]:
            raise ValueError(
                f"leaf {q.path!r} has {x.shape[0]} of its {self.shapes[q.leaf][0]} layers here: "
                "its layer axis (0) is split (a sharded outer state splits a leaf along its "
                "largest dim that the data axis divides); fragments need it whole"
            )
        return x[np.asarray(q.index)]

    def put(self, tree: Any, p: int, values: list[jax.Array]) -> Any:
        """``tree`` with fragment ``p``'s pieces replaced by ``values``."""
        leaves, treedef = jax.tree.flatten(tree)
        leaves = list(leaves)
        for q, v in zip(self.fragments[p], values, strict=True):
            if q.index is None:
                leaves[q.leaf] = v.astype(leaves[q.leaf].dtype)
            else:
                x = leaves[q.leaf]
                self._layers(x, q)
                leaves[q.leaf] = x.at[np.asarray(q.index)].set(v.astype(x.dtype))
        return jax.tree.unflatten(treedef, leaves)

    def elements(self, p: int) -> int:
        """How many elements fragment ``p`` holds."""
        total = 0
        for q in self.fragments[p]:
            shape = self.shapes[q.leaf]
            size = int(np.prod(shape, dtype=np.int64))
            total += size if q.index is None else size // shape[0] * len(q.index)
        return total

    def coverage(self) -> list[np.ndarray]:
        """Per leaf, how many fragments hold each element (1 everywhere for a partition)."""
        counts = [np.zeros(s, np.int32) for s in self.shapes]
        for frag in self.fragments:
            for q in frag:
                if q.index is None:
                    counts[q.leaf] += 1
                else:
                    np.add.at(counts[q.leaf], np.asarray(q.index), 1)
        return counts


def _path(keypath) -> str:
    return "/".join(
        str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in keypath
    )


def make_fragments(
    params: Any,
    count: int,
    *,
    strategy: str = "strided",
    stacked: str | None = None,
    layers: str | None = None,
    patterns: list[str] | None = None,
    assign: dict[str, int] | None = None,
) -> Fragments:
    r"""Partitions ``params`` into ``count`` fragments.

    Args:
      params: the parameters (arrays or ShapeDtypeStructs).
      count: P, the number of fragments (>= 1).
      strategy: ``"strided"`` or ``"sequential"`` over the layers.
      stacked: a regex; leaves whose path matches stack layers on their leading axis and are
        split per layer.
      layers: a regex with one group capturing a layer number (e.g. ``r"blocks/(\d+)/"``):
        whole leaves whose path matches belong to that layer (per-layer leaves, as in an
        unstacked transformer). With neither ``stacked`` nor ``layers``, every leaf is a
        layer of its own, in tree order.
      patterns: instead of a strategy, one regex per fragment; a leaf goes to the first
        fragment whose pattern matches its path (leaves matching none: see ``assign``).
      assign: ``{regex: fragment}`` for leaves that are not layers (embeddings, head); the
        default is fragment 0.

    Raises:
      ValueError: for a bad count, strategy or fragment index, a stacked leaf with fewer
        layers than fragments would leave a fragment empty, or an empty fragment.
    """
    count = check_int("count", count, 1)
    if patterns is None and strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got strategy={strategy!r}")
    if patterns is not None and len(patterns) != count:
        raise ValueError(
            f"patterns must give one regex per fragment ({count}), got {len(patterns)}"
        )
    assign = dict(assign or {})
    for pattern, p in assign.items():
        if not (isinstance(p, int) and 0 <= p < count):
            raise ValueError(f"assign[{pattern!r}] must be a fragment in [0, {count}), got {p!r}")
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    paths = [_path(kp) for kp, _ in flat]
    shapes = tuple(tuple(x.shape) for _, x in flat)
    pieces: list[list[Piece]] = [[] for _ in range(count)]

    def assigned(path: str) -> int:
        for pattern, p in assign.items():
            if re.search(pattern, path):
                return p
        return 0

    if patterns is not None:
        for i, path in enumerate(paths):
            hit = next((p for p, pat in enumerate(patterns) if re.search(pat, path)), None)
            pieces[assigned(path) if hit is None else hit].append(Piece(i, path))
    else:
        units: list[tuple[int, int | None]] = []  # (leaf, layer slice or None)
        depth_of: dict[tuple[int, int | None], int] = {}
        others: list[int] = []
        for i, path in enumerate(paths):
            found = re.search(layers, path) if layers is not None else None
            if stacked is not None and re.search(stacked, path):
                if not shapes[i]:
                    raise ValueError(f"stacked leaf {path!r} has no leading layer axis")
                for k in range(shapes[i][0]):
                    units.append((i, k))
                    depth_of[(i, k)] = k
            elif found is not None:
                units.append((i, None))
                depth_of[(i, None)] = int(found.group(1))
            elif stacked is None and layers is None:
                units.append((i, None))
                depth_of[(i, None)] = i
            else:
                others.append(i)
        depth = sorted(set(depth_of.values()))
        slots = {k: n for n, k in enumerate(depth)}
        key = lambda item: slots[depth_of[item]]
        n_layers = len(depth)
        layers_list = units
        if n_layers < count:
            raise ValueError(
                f"{n_layers} layers cannot fill {count} fragments (count={count}); "
                "use fewer fragments or split stacked leaves (stacked=...)"
            )

        def fragment_of(slot: int) -> int:
            if strategy == "strided":
                return slot % count
            return slot * count // n_layers

        by_leaf: dict[tuple[int, int], list[int]] = {}
        for leaf, k in layers_list:
            p = fragment_of(key((leaf, k)))
            if k is None:
                pieces[p].append(Piece(leaf, paths[leaf]))
            else:
                by_leaf.setdefault((leaf, p), []).append(k)
        for (leaf, p), ks in sorted(by_leaf.items()):
            pieces[p].append(Piece(leaf, paths[leaf], tuple(ks)))
        for i in others:
            pieces[assigned(paths[i])].append(Piece(i, paths[i]))
    for p, frag in enumerate(pieces):
        if not frag:
            raise ValueError(f"fragment {p} of {count} is empty; use fewer fragments")
    ordered = tuple(tuple(sorted(f, key=lambda q: (q.leaf, q.index or ()))) for f in pieces)
    return Fragments(treedef, shapes, ordered)
