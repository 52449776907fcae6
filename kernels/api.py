"""The fused outer update on pytrees, dispatched to the Pallas kernel or the jnp reference.

``implementation``:

- ``"xla"``: :func:`~co2jax.kernels.reference.outer_update_reference` leaf by leaf; XLA fuses
  it (on TPU the plain update already reaches the minimum bytes; ``docs/kernels.md``).
- ``"pallas"``: the kernel compiled for the target backend (Mosaic on TPU). Refused on GPU
  (Triton: traced under jit it disagreed with the reference on an H200, ``docs/kernels.md``).
  Where the kernel raises ``NotImplementedError`` (no lowering for the backend, an unsupported
  dtype) the reference runs instead, with a warning.
- ``"interpret"``: the kernel under Pallas' interpreter (any backend; for tests and debugging).
- ``"auto"``: the kernel where it was measured to move fewer bytes than XLA: on TPU for R >= 2
  gathered payloads (1.00x the minimum against XLA's 1.19-1.24x, ``docs/kernels.md``); the
  reference everywhere else (CPU; TPU with a reduced payload, where XLA already reaches the
  minimum; GPU, where XLA was faster, measured on an H200).

The target backend is the ``backend`` argument of each entry point, else the platform of the
mesh the program is traced on (:func:`current_backend`): the engines trace their rounds on
their mesh, so ahead-of-time compilation for a TPU topology on a CPU host traces the TPU path.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from co2jax.kernels.layout import Gathered, Layout, make_layout
from co2jax.kernels.outer_update import kernel_inputs, outer_update_pallas
from co2jax.kernels.reference import OuterUpdateOut, outer_update_reference
from co2jax.kernels.spec import LANES, BlockSizes, OuterUpdateSpec, default_block_sizes

IMPLEMENTATIONS = ("auto", "pallas", "interpret", "xla")
LOWERED = ("tpu", "gpu", "cuda", "rocm")  # backends Pallas compiles for (Mosaic, Triton)
GPU_BACKENDS = ("gpu", "cuda", "rocm")  # the fused update refuses "pallas" there
_SUPPORTED = {np.dtype(jnp.float32), np.dtype(jnp.bfloat16)}


def current_backend() -> str:
    """The backend a program is traced for: the platform of the mesh it is traced on (the
    engines trace their rounds on their mesh, so ahead-of-time compilation for a TPU
    topology on a CPU host traces the TPU path), else ``jax.default_backend()``. Every
    kernel entry point also takes ``backend=`` to say it outright."""
    mesh = jax.sharding.get_abstract_mesh()
    platform = None if mesh.empty else getattr(mesh.abstract_device, "platform", None)
    return platform or jax.default_backend()


def check_implementation(implementation: Any) -> str:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {IMPLEMENTATIONS}, "
            f"got implementation={implementation!r}"
        )
    return implementation


def resolve(implementation: str, replicas: int | None = None, backend: str | None = None) -> str:
    """What ``implementation`` runs as: the one resolution every kernel of the package uses.

    ``"auto"`` is the Pallas kernel on TPU where it was measured to beat XLA: an encoding pass
    (``replicas=None``) or a pass that reduces ``replicas >= 2`` payloads; ``"xla"`` elsewhere
    (CPU; GPU, where XLA moved 1.1-2.1x the kernel's GB/s on an H200 at 1e8 parameters; a
    single reduced payload, where XLA's fusion already reaches the minimum bytes).
    (:func:`outer_update` refuses ``"pallas"`` on GPU: its Triton kernel traced under jit
    disagreed with the reference there; cause not established.) ``"pallas"`` on a backend
    without a Pallas lowering runs the jnp reference, with a warning.
    ``"interpret"`` and ``"xla"`` are returned as they are.
    """
    check_implementation(implementation)
    backend = backend or current_backend()
    if implementation == "auto":
        wins = replicas is None or replicas >= 2
        return "pallas" if backend == "tpu" and wins else "xla"
    if implementation == "pallas" and backend not in LOWERED:
        warnings.warn(
            f"no Pallas lowering for backend {backend!r}: running the jnp reference",
            stacklevel=3,
        )
        return "xla"
    return implementation


def gather_layout(
    payload: Any, block_sizes: BlockSizes | None = None, backend: str | None = None
) -> Layout:
    """The bucket layout an all-gather should send ``payload`` in for the fused update."""
    block_sizes = block_sizes or default_block_sizes(backend or current_backend())
    return make_layout(payload, block_sizes.block_rows)


def outer_update(
    spec: OuterUpdateSpec,
    payload: Any,
    anchor: Any,
    momentum: Any = None,
    params: Any = None,
    old_pending: Any = None,
    gap_scale: Any = None,
    *,
    apply: jax.Array | bool = True,
    gap_correction: jax.Array | float = 1.0,
    implementation: str = "auto",
    block_sizes: BlockSizes | None = None,
    backend: str | None = None,
) -> OuterUpdateOut:
    """One fused outer step on pytrees (see :class:`~co2jax.kernels.spec.OuterUpdateSpec`).

    Args:
      spec: what to compute.
      payload: the reduced pseudo-gradient (a pytree shaped like ``anchor``) or the
        replicas' un-reduced payloads as :class:`~co2jax.kernels.layout.Gathered`.
      anchor, momentum, params, old_pending, gap_scale: pytrees shaped like the parameters
        (which ones the spec needs: see ``outer_update_reference``).
      apply: 0-d bool; False keeps anchor, momentum and gap average.
      gap_correction: the gap average's bias correction ``1 - gap_decay**n``.
      implementation: ``"auto"``, ``"pallas"``, ``"interpret"`` or ``"xla"``.
      block_sizes: the kernel's tiling (default per backend).
      backend: the backend to trace for (default: :func:`current_backend`).

    Returns:
      :class:`~co2jax.kernels.reference.OuterUpdateOut` of pytrees (``penalty_sum`` summed
      over every leaf).

    Example:
      >>> import jax.numpy as jnp
      >>> spec = OuterUpdateSpec(learning_rate=1.0, momentum=0.5, clip=1.5)
      >>> tree = {"w": jnp.zeros(3)}
      >>> out = outer_update(spec, {"w": jnp.full(3, 2.0)}, tree, tree,
      ...                    implementation="interpret")
      >>> out.anchor["w"]  # m = clip(2) = 1.5
      Array([-1.5, -1.5, -1.5], dtype=float32)
    """
    direct = lambda g: len(g.parts) == 1 and g.layout.treedef == jax.tree.structure(anchor)
    if isinstance(payload, Gathered) and not direct(payload):  # in parts, over leaf lists
        step = lambda part_payload, sub: outer_update(
            spec,
            part_payload,
            *sub,
            apply=apply,
            gap_correction=gap_correction,
            implementation=implementation,
            block_sizes=block_sizes,
            backend=backend,
        )
        return _by_parts(step, payload, (anchor, momentum, params, old_pending, gap_scale))
    replicas = payload.replicas if isinstance(payload, Gathered) else 1
    backend = backend or current_backend()
    impl = resolve(implementation, replicas, backend)
    if impl == "pallas" and backend in GPU_BACKENDS:
        raise ValueError(
            "implementation='pallas': on GPU the fused update's Triton kernel, traced under "
            "jit, disagrees with the reference (measured on an H200, jax 0.11.2; "
            "docs/kernels.md, GPU); use 'xla' (what 'auto' runs there)"
        )
    trees = dict(
        anchor=anchor, momentum=momentum, params=params, old_pending=old_pending, gap=gap_scale
    )
    _check_trees(spec, payload, trees)
    if impl == "xla":
        return _reference(spec, payload, trees, apply, gap_correction)
    try:
        return _pallas(spec, payload, trees, apply, gap_correction, impl, block_sizes, backend)
    except NotImplementedError as e:
        warnings.warn(f"fused outer update: {e}; using the XLA reference", stacklevel=2)
        return _reference(spec, payload, trees, apply, gap_correction)


def _by_parts(step, payload: Gathered, trees: tuple) -> OuterUpdateOut:
    """:func:`outer_update` run on each part of a payload gathered in several buffers, over
    that part's leaves, and the outputs put back together."""
    structure = jax.tree.structure(trees[0])
    columns = [_leaves_or_none(t) for t in trees]
    fields = ("anchor", "momentum", "pending", "gap_scale")
    merged: dict[str, list | None] = {f: None for f in fields}
    total = jnp.zeros([], jnp.float32)
    for part in payload.parts:
        sub = [None if c is None else [c[i] for i in part.leaves] for c in columns]
        out = step(Gathered(part.buffer, part.layout, part.scales), sub)
        for f in fields:
            values = getattr(out, f)
            if values is not None:
                merged[f] = merged[f] or [None] * structure.num_leaves
                for i, x in zip(part.leaves, values, strict=True):
                    merged[f][i] = x
        total = total + out.penalty_sum
    unflatten = lambda leaves: None if leaves is None else jax.tree.unflatten(structure, leaves)
    return OuterUpdateOut(*(unflatten(merged[f]) for f in fields), total)


def _check_trees(spec, payload, trees):
    need = {
        "momentum": spec.momentum is not None,
        "params": spec.delayed,
        "old_pending": bool(spec.eager_replicas),
        "gap": spec.penalty == "gap_aware",
    }
    structure = jax.tree.structure(trees["anchor"])
    for name, needed in need.items():
        if needed and trees[name] is None:
            raise ValueError(f"this spec needs {name}, got {name}=None (spec={spec})")
        if needed and jax.tree.structure(trees[name]) != structure:
            raise ValueError(
                f"{name} must have the anchor's tree structure, got {name}={trees[name]}"
            )
    if isinstance(payload, Gathered):
        if payload.layout.treedef != structure:
            raise ValueError("the gathered payload's layout does not match the anchor's tree")
    elif jax.tree.structure(payload) != structure:
        raise ValueError(f"payload must have the anchor's tree structure, got payload={payload}")


def _leaves_or_none(tree):
    return None if tree is None else jax.tree.leaves(tree)


def _reference(spec, payload, trees, apply, gap_correction) -> OuterUpdateOut:
    g = payload.mean() if isinstance(payload, Gathered) else payload
    structure = jax.tree.structure(trees["anchor"])
    cols = {k: _leaves_or_none(v) for k, v in trees.items()}
    outs = []
    for i, (p, a) in enumerate(zip(jax.tree.leaves(g), cols["anchor"], strict=True)):
        pick = lambda name, i=i: None if cols[name] is None else cols[name][i]
        outs.append(
            outer_update_reference(
                spec,
                p[None],
                a,
                pick("momentum"),
                pick("params"),
                pick("old_pending"),
                pick("gap"),
                apply=apply,
                gap_correction=gap_correction,
            )
        )
    return _assemble(structure, outs)


def _assemble(structure, outs: list[OuterUpdateOut]) -> OuterUpdateOut:
    def tree(field):
        values = [getattr(o, field) for o in outs]
        return None if values and values[0] is None else jax.tree.unflatten(structure, values)

    total = sum((o.penalty_sum for o in outs), jnp.zeros([], jnp.float32))
    return OuterUpdateOut(
        tree("anchor"), tree("momentum"), tree("pending"), tree("gap_scale"), total
    )


def _row(value) -> jax.Array:
    return jnp.broadcast_to(jnp.asarray(value, jnp.float32).reshape(1, 1), (1, LANES))


def _pallas(
    spec, payload, trees, apply, gap_correction, impl, block_sizes, backend
) -> OuterUpdateOut:
    interpret = impl == "interpret"
    if not interpret and backend not in LOWERED:
        raise NotImplementedError(f"no Pallas lowering of the kernel for backend {backend!r}")
    anchors = jax.tree.leaves(trees["anchor"])
    for name, tree in trees.items():
        for x in _leaves_or_none(tree) or ():
            if np.dtype(x.dtype) not in _SUPPORTED:
                raise NotImplementedError(f"{name} has dtype {x.dtype}; the kernel takes f32/bf16")
    if isinstance(payload, Gathered):
        layout = payload.layout
        block_sizes = BlockSizes(layout.block_rows, (block_sizes or BlockSizes()).num_warps)
        buffer = payload.buffer
    else:
        block_sizes = block_sizes or default_block_sizes(backend)
        signatures = [
            (str(a.dtype), str(p.dtype))
            for a, p in zip(anchors, jax.tree.leaves(payload), strict=True)
        ]
        layout = make_layout(trees["anchor"], block_sizes.block_rows, signatures)
        buffer = None
    cols = {k: _leaves_or_none(v) for k, v in trees.items()}
    names = {"momentum": "momentum", "params": "params", "old_pending": "old_pending"}
    names["gap"] = "gap_scale"
    pieces: dict[str, list] = {k: [] for k in ("anchor", "momentum", "pending", "gap_scale")}
    total = jnp.zeros([], jnp.float32)
    for seg in layout.segments:
        arrays = {"anchor": layout.segment(cols["anchor"], seg), "apply": _row(apply)}
        for key, name in names.items():
            if cols[key] is not None and name in kernel_inputs(spec):
                arrays[name] = layout.segment(cols[key], seg)
        if spec.penalty == "gap_aware":
            arrays["gap_correction"] = _row(gap_correction)
        if buffer is not None:
            arrays["payloads"] = buffer
            if payload.scales is not None:
                arrays["payload_scales"] = payload.scales
            offset = seg.offset_rows // layout.block_rows
        else:
            arrays["payloads"] = layout.segment(jax.tree.leaves(payload), seg)[None]
            offset = 0
        out = outer_update_pallas(
            spec,
            arrays,
            valid=seg.valid,
            payload_block_offset=offset,
            block_sizes=block_sizes,
            backend=backend,
            interpret=interpret,
        )
        for key in pieces:
            if key in out:
                pieces[key].append(out[key])
        if "penalty_sum" in out:
            total = total + jnp.sum(out["penalty_sum"][:, 0, :])
    if spec.penalty != "gap_aware":
        scale = spec.penalty_scale if spec.penalty == "constant" else 1.0
        total = jnp.asarray(scale * layout.elements, jnp.float32)

    def tree(key, like):
        if not pieces[key]:
            return None
        dtypes = [x.dtype for x in jax.tree.leaves(like)]
        return layout.from_segments(pieces[key], dtypes)

    return OuterUpdateOut(
        tree("anchor", trees["anchor"]),
        tree("momentum", trees["momentum"]),
        tree("pending", trees["anchor"]),
        tree("gap_scale", trees["gap"]),
        total,
    )


def state_names(spec: OuterUpdateSpec) -> list[str]:
    """The state buffers ``spec`` reads, named as :func:`outer_update`'s arguments."""
    return [x for x in kernel_inputs(spec) if x not in ("payloads", "apply", "gap_correction")]


def gathered_step(
    spec: OuterUpdateSpec,
    layout: Layout,
    implementation: str = "auto",
    backend: str | None = None,
):
    """``step(buffer, state, scales=None) -> state``: the fused update of a ``[R, rows, 128]``
    gathered buffer (int8 codes with ``scales [R, rows]``, or floats) and a dict of state
    pytrees (keys from :func:`state_names`), returning the state in the same structure, ready
    for ``jax.jit(step, donate_argnums=1)``."""

    def step(buffer: jax.Array, state: dict, scales: jax.Array | None = None) -> dict:
        out = outer_update(
            spec,
            Gathered(buffer, layout, scales),
            state["anchor"],
            state.get("momentum"),
            state.get("params"),
            state.get("old_pending"),
            state.get("gap_scale"),
            implementation=implementation,
            backend=backend,
        )
        return as_state(state, out)

    return step


def as_state(state: dict, out: OuterUpdateOut) -> dict:
    """``out`` in the structure of ``state`` (keys named as :func:`outer_update`'s arguments):
    each output in the place of the input it replaces, the new pending over ``old_pending``
    (eager) or ``params``. Returning this from a jitted update with ``state`` donated lets
    XLA pair every output with its own input buffer."""
    new = {"anchor": out.anchor, "momentum": out.momentum, "gap_scale": out.gap_scale}
    new["old_pending" if "old_pending" in state else "params"] = out.pending
    return {k: new.get(k) for k in state}


def minimum_bytes(spec: OuterUpdateSpec, elements: int, replicas: int, dtype, payload_dtype) -> int:
    """Bytes a perfect fused update moves: every input read once, every output written once."""
    item = np.dtype(dtype).itemsize
    reads = replicas * np.dtype(payload_dtype).itemsize + item  # payloads, anchor
    writes = item
    if spec.momentum is not None:
        reads, writes = reads + item, writes + item
    if spec.delayed:
        reads, writes = reads + item, writes + item
    if spec.eager_replicas:
        reads += item
    if spec.penalty == "gap_aware":
        reads, writes = reads + 4, writes + 4
    return math.prod((elements, reads + writes))
