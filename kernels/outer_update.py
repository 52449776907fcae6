"""The fused reduce-and-update: one Pallas kernel, one pass over memory.

Every grid step loads one ``(block_rows, 128)`` block of each input (the R gathered payloads,
the anchor, the momentum, the local params, the eager correction's old payload, the gap
average), computes :class:`~co2jax.kernels.spec.OuterUpdateSpec`'s step in float32 registers
and stores one block of each output. Outputs alias their inputs (``input_output_aliases``):
the anchor, momentum and gap average are updated in place and the new pending payload
overwrites the old one (eager) or the local params (delayed), so with donated buffers the kernel
allocates nothing.

Lowerings: Mosaic on TPU (blocks are whole (8, 128) tiles; the grid axis is "parallel" so both
TensorCores of a megacore chip share it), Triton on GPU, and Pallas' interpreter anywhere
(tests, CPU). Ragged data is handled by the grid: the last block may run past the arrays,
its out-of-bounds rows are not written, and the penalty sum masks every element past
``valid``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from co2jax.kernels.layout import as_column, same_varying_axes, whole_per_device
from co2jax.kernels.spec import LANES, BlockSizes, OuterUpdateSpec


def kernel_inputs(spec: OuterUpdateSpec) -> tuple[str, ...]:
    """The names of the kernel's array inputs for ``spec``, in the order it takes them."""
    names = ["payloads", "anchor"]
    if spec.momentum is not None:
        names.append("momentum")
    if spec.delayed:
        names.append("params")
    if spec.eager_replicas:
        names.append("old_pending")
    if spec.penalty == "gap_aware":
        names += ["gap_scale", "gap_correction"]
    names.append("apply")
    return tuple(names)


def _outputs(spec: OuterUpdateSpec) -> tuple[str, ...]:
    names = ["anchor"]
    if spec.momentum is not None:
        names.append("momentum")
    if spec.delayed:
        names.append("pending")
    if spec.penalty == "gap_aware":
        names += ["gap_scale", "penalty_sum"]
    return tuple(names)


# each output overwrites the input it replaces; the new pending payload takes the old one's
# buffer (eager) or the local params' (which the new anchor replaces)
_ALIAS = {"anchor": "anchor", "momentum": "momentum", "pending": "params", "gap_scale": "gap_scale"}


def _alias_source(spec: OuterUpdateSpec, output: str) -> str | None:
    if output == "pending" and spec.eager_replicas:
        return "old_pending"
    return _ALIAS.get(output)


def _outer_update_kernel(
    *refs, spec: OuterUpdateSpec, ins: tuple[str, ...], replicas: int, block_rows: int, valid: int
):
    r = dict(zip(ins, refs[: len(ins)], strict=True))
    o = dict(zip(_outputs(spec), refs[len(ins) :], strict=True))
    f32 = jnp.float32

    def payload(k):  # replica k's block, decoded (int8 codes times the row's scale)
        values = r["payloads"][k].astype(f32)
        if "payload_scales" not in r:
            return values
        # the block's scales are lane-dense (1, block_rows): one per row, as a column
        return values * as_column(r["payload_scales"][pl.ds(k, 1), :].astype(f32))

    g = payload(0)
    for k in range(1, replicas):
        g = g + payload(k)
    if replicas > 1:
        g = g * (1.0 / replicas)
    anchor = r["anchor"][...]
    a = anchor.astype(f32)
    apply = r["apply"][...] > 0.5  # (1, 128), broadcast over the block's rows

    if spec.delayed:
        pending = (a - r["params"][...].astype(f32)).astype(o["pending"].dtype)
        o["pending"][...] = pending
        if spec.eager_replicas:
            old = r["old_pending"][...].astype(f32)
            g = g + (pending.astype(f32) - old) * (1.0 / spec.eager_replicas)

    if spec.momentum is not None:
        m_old = r["momentum"][...]
    if spec.penalty == "constant":
        g = g * spec.penalty_scale
    elif spec.penalty == "gap_aware":
        previous = (a + spec.learning_rate * m_old.astype(f32)).astype(anchor.dtype)
        gap = jnp.abs(a - previous.astype(f32))
        c = r["gap_scale"][...].astype(f32)
        corr = r["gap_correction"][...]
        c_hat = jnp.where(corr > 0, c / jnp.where(corr > 0, corr, 1.0), 0.0)
        known = c_hat > spec.gap_eps
        lam = jnp.where(known, 1.0 / (1.0 + gap / jnp.where(known, c_hat, 1.0)), 1.0)
        g = lam * g
        new_c = spec.gap_decay * c + (1.0 - spec.gap_decay) * gap
        o["gap_scale"][...] = jnp.where(apply, new_c, c).astype(o["gap_scale"].dtype)
        row = pl.program_id(0) * block_rows + jax.lax.broadcasted_iota(jnp.int32, g.shape, 0)
        index = row * LANES + jax.lax.broadcasted_iota(jnp.int32, g.shape, 1)
        lam = jnp.where(index < valid, lam, 0.0)
        o["penalty_sum"][0] = jnp.broadcast_to(jnp.sum(lam, axis=0, keepdims=True), (8, LANES))

    if spec.momentum is None:
        u = g
    else:
        m = (spec.momentum * m_old.astype(f32) + g).astype(m_old.dtype)
        if spec.clip is not None:
            m = jnp.clip(m, -spec.clip, spec.clip)
        o["momentum"][...] = jnp.where(apply, m, m_old)
        u = g + spec.momentum * m.astype(f32) if spec.nesterov else m.astype(f32)
    new_anchor = (a - spec.learning_rate * u).astype(anchor.dtype)
    o["anchor"][...] = jnp.where(apply, new_anchor, anchor)


def _compiler_params(backend: str, block_sizes: BlockSizes):
    if backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.CompilerParams(dimension_semantics=("parallel",))
    if backend in ("gpu", "cuda", "rocm"):
        from jax.experimental.pallas import triton as plgpu

        return plgpu.CompilerParams(num_warps=block_sizes.num_warps, num_stages=1)
    return None


def outer_update_pallas(
    spec: OuterUpdateSpec,
    arrays: dict[str, jax.Array],
    *,
    valid: int,
    payload_block_offset: int = 0,
    block_sizes: BlockSizes,
    backend: str,
    interpret: Any = False,
    alias: bool = True,
) -> dict[str, jax.Array]:
    """Runs the kernel on one bucket.

    Args:
      spec: what to compute.
      arrays: by name (see ``kernel_inputs``): ``payloads`` ``[R, P, 128]`` whose rows
        ``payload_block_offset * block_rows`` onward hold this bucket (optionally int8 codes
        with ``payload_scales`` ``[R, P]``, one float32 scale per row); every other array
        ``[rows, 128]``; the dynamic scalars ``apply`` and ``gap_correction`` as float32
        ``[1, 128]`` rows (the value repeated on every lane).
      valid: how many leading elements of the ``rows * 128`` are real (the rest is padding,
        left out of the penalty sum).
      payload_block_offset: where this bucket starts in the payload buffer, in blocks.
      block_sizes: the tiling.
      backend: ``"tpu"`` (Mosaic), ``"gpu"`` (Triton) or anything with ``interpret=True``.
      interpret: run Pallas' interpreter instead of compiling for ``backend`` (``True``, or
        ``pltpu.InterpretParams(...)`` for the TPU interpreter, which starts outputs as NaN).
      alias: write each output over the input it replaces (tests turn it off to see every
        output element written).

    Returns:
      The outputs by name (see ``_outputs``); ``penalty_sum`` is ``[blocks, 8, 128]`` partial
      sums (read ``[:, 0, :]``).
    """
    ins = kernel_inputs(spec)
    if "payload_scales" in arrays:  # int8 payloads with a float32 scale per row
        ins = (ins[0], "payload_scales", *ins[1:])
    rows = arrays["anchor"].shape[0]
    br = block_sizes.block_rows
    blocks = pl.cdiv(rows, br)
    replicas = arrays["payloads"].shape[0]
    if arrays["payloads"].shape[1] < payload_block_offset * br + rows:
        raise ValueError(
            f"payloads has {arrays['payloads'].shape[1]} rows; the bucket needs "
            f"{payload_block_offset * br + rows} (offset {payload_block_offset} blocks)"
        )
    row_block = pl.BlockSpec((br, LANES), lambda i: (i, 0))
    scalar_block = pl.BlockSpec((1, LANES), lambda i: (0, 0))
    specs = {
        "payloads": pl.BlockSpec((replicas, br, LANES), lambda i: (0, payload_block_offset + i, 0)),
        "payload_scales": pl.BlockSpec((replicas, br), lambda i: (0, payload_block_offset + i)),
        "apply": scalar_block,
        "gap_correction": scalar_block,
    }
    in_specs = [specs.get(n, row_block) for n in ins]
    outs = _outputs(spec)
    shapes, out_specs = [], []
    for name in outs:
        if name == "penalty_sum":
            shapes.append(jax.ShapeDtypeStruct((blocks, 8, LANES), jnp.float32))
            out_specs.append(pl.BlockSpec((1, 8, LANES), lambda i: (i, 0, 0)))
        else:
            like = arrays[_ALIAS[name]] if name != "pending" else arrays["anchor"]
            shapes.append(jax.ShapeDtypeStruct((rows, LANES), like.dtype))
            out_specs.append(row_block)
    aliases = {}
    for j, name in enumerate(outs):
        source = _alias_source(spec, name)
        if alias and source in ins and arrays[source].dtype == shapes[j].dtype:
            aliases[ins.index(source)] = j
    # What the pipeline moves: every block of every operand once (edge blocks are clipped to
    # the array; the payload region is whole blocks; the scalar rows once). A Mosaic kernel is
    # opaque to XLA's cost analysis, which reports this estimate for it.
    moved = (
        sum(
            (replicas * blocks * br if n == "payloads" else rows) * LANES * arrays[n].dtype.itemsize
            for n in ins
            if n not in ("apply", "gap_correction", "payload_scales")
        )
        + 4 * replicas * blocks * br * ("payload_scales" in arrays)
        + sum(rows * LANES * s.dtype.itemsize for s in shapes if s.shape[0] == rows)
    )
    cost = pl.CostEstimate(
        flops=blocks * br * LANES * (replicas + 12), transcendentals=0, bytes_accessed=moved
    )
    operands = same_varying_axes([arrays[n] for n in ins])
    if operands:
        kind = jax.typeof(operands[0]).manual_axis_type
        shapes = [jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=kind) for s in shapes]
    kernel = functools.partial(
        _outer_update_kernel, spec=spec, ins=ins, replicas=replicas, block_rows=br, valid=valid
    )
    call = pl.pallas_call(
        kernel,
        out_shape=tuple(shapes),
        grid=(blocks,),
        in_specs=in_specs,
        out_specs=tuple(out_specs),
        input_output_aliases=aliases,
        compiler_params=None if interpret is not False else _compiler_params(backend, block_sizes),
        cost_estimate=cost,
        interpret=interpret,
        name="co2jax_outer_update",
    )
    operands = operands or [arrays[n] for n in ins]
    results = call(*operands) if interpret else whole_per_device(call, *operands)
    return dict(zip(outs, results, strict=True))
