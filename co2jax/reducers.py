"""Cross-replica reductions with the same result and different schedules.

Every reducer maps this replica's payload pytree to the element-wise mean over the replica
axis. They differ in how the compiler can schedule them (measured in ``docs/overlap.md``):

- :func:`pmean` (``lax.pmean``, an all-reduce): the default; XLA:TPU schedules it
  synchronously after an independent loop, so it cannot hide behind the inner steps there.
- :func:`all_gather_mean`: an all-gather of the payload then a local float32 sum. XLA:TPU
  issues it as an asynchronous start/done pair around an independent loop. Each replica
  receives (R-1) payloads, versus 2(R-1)/R for a ring all-reduce: best for small R.
- :func:`ring_mean`: a ring of ``ppermute`` steps (reduce-scatter then all-gather, R-1 steps
  each) on the flattened payload, summed in float32. Collective permutes are asynchronous on
  TPU; traffic is the all-reduce's 2(R-1)/R payloads per replica, in 2(R-1) latency steps.

All three equal the mean up to float rounding (summation order), and keep leaf dtypes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from co2jax._base import REPLICA_AXIS, Payload, Reducer, check_axis, check_axis_name, replica_mean
from co2jax.compression import flatten as _flatten
from co2jax.kernels.api import gather_layout
from co2jax.kernels.layout import Gathered
from co2jax.kernels.spec import LANES

KINDS = ("pmean", "all_gather", "ring")


def pmean(axis_name: str = REPLICA_AXIS) -> Reducer:
    """The all-reduce mean, ``lax.pmean`` (same as :func:`co2jax.replica_mean`)."""
    return replica_mean(axis_name)


def all_gather_mean(axis_name: str = REPLICA_AXIS) -> Reducer:
    """All-gather every replica's payload as one flat float32 buffer, then average locally.

    One collective for the whole payload: XLA:TPU keeps one asynchronous collective in flight
    across a loop, so a collective per leaf would leave all but one synchronous.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> jax.vmap(all_gather_mean("replica"), axis_name="replica")(jnp.array([1.0, 2.0, 6.0]))
      Array([3., 3., 3.], dtype=float32)
    """
    check_axis_name("axis_name", axis_name)

    def reduce(payload: Payload) -> Payload:
        check_axis(axis_name)
        if not jax.tree.leaves(payload):
            return payload
        flat, unflatten = _flatten(payload)
        return unflatten(jnp.mean(jax.lax.all_gather(flat, axis_name), axis=0))

    return reduce


def all_gather_stacked(
    axis_name: str = REPLICA_AXIS,
    block_sizes=None,
    quantize: str | None = None,
    implementation: str = "auto",
) -> Reducer:
    """All-gather every replica's payload, left un-reduced for a fused outer update.

    The payload is packed in the fused kernel's bucket layout (:mod:`co2jax.kernels.layout`)
    in its own dtype (float32 when the leaves' dtypes differ), gathered as one buffer, and
    returned as :class:`co2jax.kernels.Gathered`: an ``apply`` that accepts it
    (``OuterOptimizer.accepts_gathered``) averages the R payloads inside its update pass
    instead of in a fusion of their own.

    With ``quantize="int8"`` each 128-lane row of the packed payload is quantized to int8
    with a float32 scale (:func:`co2jax.kernels.quantize.quantize_int8`, run as
    ``implementation`` says) and the codes and scales are gathered: the fused update
    dequantizes, averages and steps in one pass. ``reduce.tree_wire_bytes(shapes, R)`` is
    what one replica sends (the padded layout included).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> reduce = all_gather_stacked("replica")
      >>> jax.vmap(lambda x: reduce(x).buffer.shape[0], axis_name="replica")(jnp.ones(3))[0]
      Array(3, dtype=int32, weak_type=True)
      >>> jax.vmap(lambda x: reduce(x).mean(), axis_name="replica")(jnp.array([1.0, 2.0, 6.0]))
      Array([3., 3., 3.], dtype=float32)
    """
    check_axis_name("axis_name", axis_name)
    if quantize not in (None, "int8"):
        raise ValueError(f"quantize must be None or 'int8', got quantize={quantize!r}")

    def reduce(payload: Payload) -> Gathered:
        check_axis(axis_name)
        layout = gather_layout(payload, block_sizes)
        dtype = jnp.result_type(*(x.dtype for x in jax.tree.leaves(payload)))
        if quantize is None:
            buffer = jax.lax.all_gather(layout.pack(payload, dtype), axis_name)
            return Gathered(buffer, layout)
        from co2jax.kernels.quantize import quantize_int8

        codes, scales = quantize_int8(
            layout.pack(payload, jnp.float32), implementation=implementation
        )
        codes, scales = jax.lax.all_gather((codes, scales), axis_name)
        return Gathered(codes, layout, scales)

    def tree_wire_bytes(shapes: Payload, replicas: int) -> float:
        layout = gather_layout(shapes, block_sizes)
        if quantize is None:
            dtype = jnp.result_type(*(x.dtype for x in jax.tree.leaves(shapes)))
            row = LANES * jnp.dtype(dtype).itemsize
        else:
            row = LANES + 4  # int8 codes and a float32 scale
        return wire_bytes("all_gather", layout.total_rows * row, replicas)

    reduce.tree_wire_bytes = tree_wire_bytes
    return reduce


def ring_mean(axis_name: str = REPLICA_AXIS) -> Reducer:
    """A ppermute ring: reduce-scatter then all-gather of the flattened payload, in float32.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> x = jnp.arange(12.0).reshape(4, 3)  # 4 replicas, 3 elements each
      >>> jax.vmap(ring_mean("replica"), axis_name="replica")(x)[0]
      Array([4.5, 5.5, 6.5], dtype=float32)
    """
    check_axis_name("axis_name", axis_name)

    def reduce(payload: Payload) -> Payload:
        r = check_axis(axis_name)
        if r == 1 or not jax.tree.leaves(payload):
            return payload
        flat, unflatten = _flatten(payload)
        n = flat.size
        chunks = jnp.pad(flat, (0, (-n) % r)).reshape(r, -1)
        i = jax.lax.axis_index(axis_name)
        ring = [(j, (j + 1) % r) for j in range(r)]
        # reduce-scatter: after step s, this replica holds chunk (i - 1 - s) summed over s + 2
        # replicas; after r - 1 steps it holds the full sum of chunk (i + 1) mod r.
        acc = chunks[i]
        for s in range(r - 1):
            acc = jax.lax.ppermute(acc, axis_name, ring) + chunks[(i - 1 - s) % r]
        out = jnp.zeros_like(chunks).at[(i + 1) % r].set(acc)
        # all-gather: at step s, receive the reduced chunk (i - s) mod r from the left.
        for s in range(r - 1):
            acc = jax.lax.ppermute(acc, axis_name, ring)
            out = out.at[(i - s) % r].set(acc)
        return unflatten(out.reshape(-1)[:n] / r)

    return reduce


def make(kind: str, axis_name: str = REPLICA_AXIS) -> Reducer:
    """The reducer named ``kind`` (one of ``KINDS``)."""
    if kind not in KINDS:
        raise ValueError(f"reducer must be one of {KINDS}, got reducer={kind!r}")
    return {"pmean": pmean, "all_gather": all_gather_mean, "ring": ring_mean}[kind](axis_name)


def wire_bytes(kind: str, payload_bytes: int, replicas: int) -> float:
    """Bytes one replica sends per reduction of a ``payload_bytes`` payload (ring model)."""
    if replicas <= 1:
        return 0.0
    if kind == "all_gather":
        return float(payload_bytes) * (replicas - 1)  # forwards every other replica's payload
    return 2.0 * (replicas - 1) / replicas * payload_bytes
