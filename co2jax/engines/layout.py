"""Where the engines put per-replica state over a replica's devices: shardings, not arithmetic.

Every per-replica leaf has a leading replica axis sharded over ``replica``. Inside a replica,
its layout over ``data`` and ``model`` is a sharding that the compiler keeps (the engines map
by hand over ``replica`` only, :func:`co2jax.mesh.replica_map`), so an algorithm's math sees
whole tensors at every layout and a layout changes no value:

- **parameters**: the user's ``param_specs`` (tensor parallelism: one ``PartitionSpec`` per
  parameter over ``model``, and ``data`` if wanted); with ``fsdp`` each parameter is also
  split over ``data`` along its largest dim that ``data`` divides and no axis splits yet (a
  parameter with none stays whole over ``data``);
- **optimizer state** (inner and outer): each leaf follows the parameter it is made from. A
  leaf dim that shrinks n-fold when a parameter dim is split n ways carries that mesh axis
  (found from ``init`` on the split shapes, traced, nothing run), so anchors, momenta,
  Adam's moments, fragments' pieces and residuals lie where their parameters lie;
- **sharded outer state** (``shard_outer_state``, implied by ``fsdp``): the outer state is
  laid out as if the parameters were split over ``data`` the FSDP way, and a leaf that no
  parameter dim maps onto (a DCT momentum in chunks, say) is split over ``data`` along its
  largest dim ``data`` divides: 1/D of the outer state per device.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jax.sharding import PartitionSpec as P
  >>> layout = Layout({"data": 2, "model": 2}, fsdp=True)
  >>> shapes = {"w": jax.ShapeDtypeStruct((6, 4), jnp.float32)}
  >>> layout.param_specs(shapes, {"w": P(None, "model")})
  {'w': P('data', 'model')}
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from co2jax.axes import DATA, MODEL, REPLICA

SPLIT_AXES = (DATA, MODEL)
"""The mesh axes a replica's tensors may be split over."""


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, P)


def _entries(spec: P | None, ndim: int) -> list[tuple[str, ...]]:
    """A spec as one tuple of mesh axes per dim (``()``: whole)."""
    out: list[tuple[str, ...]] = []
    for entry in tuple(spec or ()) + (None,) * (ndim - len(tuple(spec or ()))):
        if entry is None:
            out.append(())
        elif isinstance(entry, str):
            out.append((entry,))
        else:
            out.append(tuple(entry))
    return out


def _spec(entries: list[tuple[str, ...]]) -> P:
    return P(*(None if not e else e[0] if len(e) == 1 else e for e in entries))


def full_spec(spec: P, ndim: int) -> P:
    """A per-replica spec with the leading replica axis in front (full length, so that the
    shardings jit returns equal the ones the engine places)."""
    return P(REPLICA, *_spec(_entries(spec, ndim)))


class Layout:
    """The placement of parameters, inner and outer state inside a replica.

    Args:
      sizes: the mesh's axis sizes (``data`` and ``model``; a missing axis has size 1).
      shard_outer_state: split the outer state over ``data`` (1/D per device).
      fsdp: also split the parameters (and so the inner state) over ``data``.
    """

    def __init__(self, sizes: dict, shard_outer_state: bool = False, fsdp: bool = False):
        self.sizes = {a: int(sizes.get(a, 1)) for a in SPLIT_AXES}
        self.fsdp = bool(fsdp)
        self.sharded = (bool(shard_outer_state) or self.fsdp) and self.sizes[DATA] > 1

    # ------------------------------------------------------------------------------------
    # parameters

    def check_specs(self, shapes: Any, specs: Any) -> Any:
        """``specs`` (a pytree of ``PartitionSpec`` or ``None`` like ``shapes``) checked:
        mesh axes among ``data``/``model``, each once, dims they divide. Raises a one-line
        ``ValueError`` naming the parameter."""
        if specs is None:
            return jax.tree.map(lambda _: P(), shapes)
        treedef = jax.tree.structure(shapes)
        try:
            spec_leaves = treedef.flatten_up_to(specs)
        except (ValueError, TypeError) as e:
            raise ValueError(
                f"param_specs must be a PartitionSpec (or None) per parameter, shaped like the "
                f"parameters: {str(e).splitlines()[0]}"
            ) from None
        out = []
        for (path, x), spec in zip(
            jax.tree_util.tree_leaves_with_path(shapes), spec_leaves, strict=True
        ):
            name = f"param_specs{jax.tree_util.keystr(path)}"
            if not _is_spec(spec):
                raise ValueError(f"{name} must be a PartitionSpec or None, got {spec!r}")
            if spec is not None and len(spec) > len(x.shape):
                raise ValueError(f"{name}={spec} has more entries than the shape {x.shape}")
            entries = _entries(spec, len(x.shape))
            used = [a for e in entries for a in e]
            for axis in used:
                if axis not in SPLIT_AXES:
                    raise ValueError(
                        f"{name}={spec}: a parameter may be split over {SPLIT_AXES} inside a "
                        f"replica, got {axis!r}"
                    )
            if len(set(used)) != len(used):
                raise ValueError(f"{name}={spec} names a mesh axis twice")
            for d, e in enumerate(entries):
                parts = math.prod(self.sizes[a] for a in e)
                if x.shape[d] % parts:
                    raise ValueError(
                        f"{name}={spec}: dim {d} of shape {x.shape} is not divisible by the "
                        f"{parts} devices of {e}"
                    )
            order = lambda e: tuple(a for a in SPLIT_AXES if a in e)  # one order everywhere
            out.append(_spec([order(e) for e in entries]))
        return jax.tree.unflatten(treedef, out)

    def _with_data(self, shapes: Any, specs: Any) -> Any:
        """``specs`` with each parameter also split over ``data`` on its largest free dim."""
        D = self.sizes[DATA]

        def leaf(x, spec):
            entries = _entries(spec, len(x.shape))
            if D <= 1 or any(DATA in e for e in entries):
                return _spec(entries)
            free = [d for d, e in enumerate(entries) if not e and x.shape[d] % D == 0]
            if free:
                d = max(free, key=lambda d: (x.shape[d], -d))
                entries[d] = (DATA,)
            return _spec(entries)

        return jax.tree.map(leaf, shapes, specs, is_leaf=_is_spec)

    def param_specs(self, shapes: Any, specs: Any = None) -> Any:
        """The parameters' specs inside a replica: ``specs`` (checked), split over ``data``
        too with ``fsdp``."""
        specs = self.check_specs(shapes, specs)
        return self._with_data(shapes, specs) if self.fsdp else specs

    # ------------------------------------------------------------------------------------
    # state made from the parameters

    def state_specs(self, init, shapes: Any, specs: Any, replicas: int, fill: bool = False):
        """The specs of ``init(params)``'s leaves (per replica) for parameters laid out as
        ``specs``: each leaf dim that shrinks n-fold when the parameters' dims split over a
        mesh axis of size n are cut n ways carries that axis. ``fill``: a leaf with no dim
        on ``data`` is split over it along its largest dim ``data`` divides."""
        stacked = lambda tree: jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((replicas, *x.shape), x.dtype), tree
        )
        abstract = lambda tree: jax.eval_shape(
            jax.vmap(init, axis_name=REPLICA, axis_size=replicas), stacked(tree)
        )
        full = abstract(shapes)
        leaves, treedef = jax.tree.flatten(full)
        found: list[list[list[str]]] = [[[] for _ in x.shape[1:]] for x in leaves]
        for axis in SPLIT_AXES:
            n = self.sizes[axis]
            if n <= 1:
                continue
            cut = jax.tree.map(lambda x, s, a=axis, n=n: _cut(x, s, a, n), shapes, specs)
            if cut is None:
                continue
            try:
                local = jax.tree.leaves(abstract(cut))
            except Exception:  # an init that cannot take the split shapes: nothing follows
                continue
            if len(local) != len(leaves):
                continue
            for j, (f, s) in enumerate(zip(leaves, local, strict=True)):
                dims = [d for d in range(1, len(f.shape)) if f.shape[d] != s.shape[d]]
                if len(dims) == 1 and f.shape[dims[0]] == s.shape[dims[0]] * n:
                    found[j][dims[0] - 1].append(axis)
        D = self.sizes[DATA]
        out = []
        for x, entries in zip(leaves, found, strict=True):
            shape = x.shape[1:]
            if fill and D > 1 and not any(DATA in e for e in entries):
                free = [d for d, e in enumerate(entries) if not e and shape[d] % D == 0]
                if free:
                    entries[max(free, key=lambda d: (shape[d], -d))].append(DATA)
            out.append(_spec([tuple(a for a in SPLIT_AXES if a in e) for e in entries]))
        return jax.tree.unflatten(treedef, out)

    def inner_specs(self, init, shapes: Any, param_specs: Any, replicas: int) -> Any:
        """The inner optimizer state's specs: each leaf where its parameter lies."""
        return self.state_specs(init, shapes, param_specs, replicas)

    def outer_param_specs(self, shapes: Any, specs: Any) -> Any:
        """Where the parameters lie while the outer step reads them: as the outer state does
        (with a sharded outer state, split over ``data`` the FSDP way; a whole parameter is
        sliced where it lies, with no communication)."""
        specs = self.check_specs(shapes, specs)
        return self._with_data(shapes, specs) if self.sharded else self.param_specs(shapes, specs)

    def outer_specs(self, init, shapes: Any, specs: Any, replicas: int) -> Any:
        """The outer state's specs: where the parameters lie, and with a sharded outer state
        where they would lie split over ``data``, every other leaf split over ``data`` too."""
        specs = self.check_specs(shapes, specs)
        if not self.sharded:
            return self.state_specs(init, shapes, specs, replicas)
        return self.state_specs(init, shapes, self._with_data(shapes, specs), replicas, True)


def _cut(x, spec: P, axis: str, n: int):
    """``x``'s shape with every dim that ``axis`` splits divided by ``n``."""
    shape = list(x.shape)
    for d, e in enumerate(_entries(spec, len(shape))):
        if axis in e:
            shape[d] //= n
    return jax.ShapeDtypeStruct(tuple(shape), x.dtype)


def without(specs: Any, axis: str) -> Any:
    """``specs`` with ``axis`` taken out of every entry: where FSDP's parameters are
    gathered for a step (split over ``model`` still, whole over ``data``)."""

    def drop(spec: P | None) -> P | None:
        if spec is None:
            return None
        return _spec([tuple(a for a in e if a != axis) for e in _entries(spec, len(spec))])

    return jax.tree.map(drop, specs, is_leaf=_is_spec)


def constrain(tree: Any, specs: Any) -> Any:
    """``tree`` held where ``specs`` say inside the replica's manual region (a sharding
    constraint: the compiler moves data to keep it, the values are unchanged)."""
    return jax.tree.map(
        lambda x, s: jax.lax.with_sharding_constraint(x, s), tree, specs, is_leaf=_is_spec
    )


def nbytes_per_device(tree: Any) -> int:
    """Bytes of ``tree``'s placed arrays held by one device (its first shard of each)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape)
        total += math.prod(shape) * x.dtype.itemsize
    return total
