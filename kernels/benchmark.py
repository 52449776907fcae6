"""Bytes moved by the fused outer update against XLA's and the minimum; GB/s on a GPU.

Run: ``python -m co2jax.kernels.benchmark`` (add ``--quick`` for two sizes; ``--int8`` for
the int8-payload table: dequantize-and-average then update, against the one fused kernel).

For each size N (1e6 .. 1e9 parameters), replica count R (1, 2, 4, 8), payload dtype and
algorithm, it compiles (ahead of time, from shapes only: nothing is allocated)

- ``xla``: the gathered payloads averaged, then the update, in jnp (what XLA fuses itself);
- ``fused``: the Pallas kernel (TPU: Mosaic, compiled for a v5p chip through libtpu;
  CPU: no Pallas lowering exists, so the column reports the kernel's block pipeline, which
  is the same figure the TPU cost analysis carries);

with every state buffer donated (as the round engine does), and prints
``compiled.cost_analysis()["bytes accessed"]`` over the minimum (each input read once, each
output written once). On a GPU it also times both (median of ``--repeats`` runs after
warm-up, device synchronized) next to a device-to-device copy of the same bytes.

A Mosaic kernel is opaque to XLA's cost analysis, which counts for it the kernel's declared
``CostEstimate``; ours is computed from the kernel's BlockSpecs (every block of every operand
moved once, ragged last blocks counted whole), so what the ratio checks is that XLA adds
nothing around the kernel (no copy for aliasing, no relayout) and that the grid covers the
data once.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp

from co2jax.kernels import api
from co2jax.kernels import quantize as qk
from co2jax.kernels.layout import Gathered, make_layout
from co2jax.kernels.outer_update import kernel_inputs
from co2jax.kernels.spec import LANES, OuterUpdateSpec, default_block_sizes

SPECS = {
    "co2": OuterUpdateSpec(1.0, 0.5, clip=1.0, delayed=True),
    "co2_gap": OuterUpdateSpec(1.0, 0.5, clip=1.0, penalty="gap_aware", delayed=True),
    "diloco": OuterUpdateSpec(0.7, 0.9, nesterov=True),
}


def _bytes(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["bytes accessed"])


def _program(spec, n, replicas, dtype, payload_dtype, backend, implementation, sharding=None):
    """The jitted update and its argument shapes (state donated)."""
    block = default_block_sizes(backend)
    leaf = jax.ShapeDtypeStruct((n,), jnp.dtype(dtype), sharding=sharding)
    layout = make_layout({"w": leaf}, block.block_rows)
    buffer = jax.ShapeDtypeStruct(
        (replicas, layout.total_rows, LANES), jnp.dtype(payload_dtype), sharding=sharding
    )
    gap = jax.ShapeDtypeStruct((n,), jnp.float32, sharding=sharding)
    shapes = {x: {"w": gap if x == "gap_scale" else leaf} for x in api.state_names(spec)}
    update = api.gathered_step(spec, layout, implementation, backend=backend)
    return jax.jit(update, donate_argnums=(1,)).lower(buffer, shapes)


def pipeline_bytes(spec, n, replicas, dtype, payload_dtype, backend) -> int:
    """Bytes the kernel's block pipeline moves for one flat leaf of n elements."""
    block = default_block_sizes(backend)
    elements = -(-n // block.block_elements) * block.block_elements
    item = jnp.dtype(dtype).itemsize
    moved = replicas * elements * jnp.dtype(payload_dtype).itemsize
    for name in kernel_inputs(spec):
        if name in ("anchor", "momentum", "params", "old_pending"):
            moved += elements * item
        elif name == "gap_scale":
            moved += elements * 4
    outs = 1 + (spec.momentum is not None) + spec.delayed
    moved += outs * elements * item + (elements * 4 if spec.penalty == "gap_aware" else 0)
    return moved


def tpu_sharding(topology: str):
    """A single-device sharding of a TPU topology (ahead-of-time compilation)."""
    if importlib.util.find_spec("libtpu") is None:
        return None
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    try:
        topo = topologies.get_topology_desc(topology_name=topology, platform="tpu")
    except Exception:
        return None
    return SingleDeviceSharding(topo.devices[0])


def _time(fn, args, repeats) -> float:
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gpu_rates(spec, n, replicas, dtype, payload_dtype, repeats):
    """Achieved GB/s of xla, fused and a copy of the minimum bytes, on the local GPU."""
    key = jax.random.key(0)
    block = default_block_sizes("gpu")
    layout = make_layout({"w": jax.ShapeDtypeStruct((n,), dtype)}, block.block_rows)
    buffer = jax.random.normal(key, (replicas, layout.total_rows, LANES), payload_dtype)
    minimum = api.minimum_bytes(spec, n, replicas, dtype, payload_dtype)
    rates = {}
    for impl in ("xla", "pallas"):
        state = {
            x: {"w": jnp.zeros((n,), jnp.float32 if x == "gap_scale" else dtype)}
            for x in api.state_names(spec)
        }
        try:
            step = jax.jit(api.gathered_step(spec, layout, impl))
            rates[impl] = minimum / _time(step, (buffer, state), repeats) / 1e9
        except ValueError:  # "pallas" is refused on GPU (co2jax.kernels.api.resolve)
            rates[impl] = float("nan")
    half = minimum // 2 // 4
    src = jnp.zeros((half,), jnp.float32)
    rates["copy"] = 2 * half * 4 / _time(jax.jit(lambda x: x + 0), (src,), repeats) / 1e9
    return rates


def _int8_programs(spec, n, replicas, backend, sharding):
    """The three ways to step on R int8 payloads (codes ``[R, rows, 128]``, a scale per row):
    ``xla`` (decode, mean and update in jnp), ``two kernels`` (the dequantize-mean kernel
    writes the float32 mean, the update kernel reads it) and ``fused`` (one kernel)."""

    block = default_block_sizes(backend)
    leaf = jax.ShapeDtypeStruct((n,), jnp.float32, sharding=sharding)
    layout = make_layout({"w": leaf}, block.block_rows)
    rows = layout.total_rows
    codes = jax.ShapeDtypeStruct((replicas, rows, LANES), jnp.int8, sharding=sharding)
    scales = jax.ShapeDtypeStruct((replicas, rows), jnp.float32, sharding=sharding)
    shapes = {x: {"w": leaf} for x in api.state_names(spec)}

    def state_step(payload, state, impl):
        out = api.outer_update(
            spec,
            payload,
            *(state.get(k) for k in ("anchor", "momentum", "params", "old_pending", "gap_scale")),
            implementation=impl,
            backend=backend,
        )
        return api.as_state(state, out)

    def fused(c, s, state, impl):
        return state_step(Gathered(c, layout, s), state, impl)

    def two_kernels(c, s, state, impl):
        mean = qk.dequantize_mean_int8(c, s, implementation=impl, backend=backend)
        return state_step(layout.unpack(mean), state, impl)

    programs = {}
    for label, fn, impl in [
        ("xla", fused, "xla"),
        ("two kernels", two_kernels, "pallas"),
        ("fused", fused, "pallas"),
    ]:
        step = jax.jit(lambda c, s, st, fn=fn, impl=impl: fn(c, s, st, impl), donate_argnums=2)
        programs[label] = step.lower(codes, scales, shapes)
    minimum = (
        replicas * rows * (LANES + 4)
        + api.minimum_bytes(spec, n, 1, jnp.float32, jnp.float32)
        - n * 4
    )  # the R codes and scales replace the one float32 payload
    return programs, minimum


def int8_table(sizes, specs, tpu) -> None:
    """Bytes over the minimum of the int8 paths on TPU (ahead of time)."""
    print("\n| update | N | R | TPU xla | TPU two kernels | TPU fused |")
    print("|---|---|---|---|---|---|")
    for name in specs:
        for n in sizes:
            for r in (2, 4, 8):
                programs, minimum = _int8_programs(SPECS[name], n, r, "tpu", tpu)
                cols = [f"{_bytes(p.compile()) / minimum:.2f}" for p in programs.values()]
                print(f"| {name} | {n:.0e} | {r} | " + " | ".join(cols) + " |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="sizes 1e6 and 1e7 only")
    parser.add_argument("--repeats", type=int, default=50, help="timed runs per GPU figure")
    parser.add_argument("--specs", default="co2,diloco", help=f"comma list of {sorted(SPECS)}")
    parser.add_argument(
        "--topology",
        default="v5p:1x1x1",
        help="TPU topology for AOT compilation (v5p: 95 GiB of HBM holds 1e9 parameters)",
    )
    parser.add_argument(
        "--int8",
        action="store_true",
        help="only the int8 payload table: decode-mean then update vs one fused kernel (TPU)",
    )
    args = parser.parse_args(argv)
    sizes = [10**6, 10**7] if args.quick else [10**6, 10**7, 10**8, 10**9]
    sizes = [-(-n // 65536) * 65536 for n in sizes]  # whole TPU blocks
    tpu = tpu_sharding(args.topology)
    gpu = jax.default_backend() == "gpu"
    print(f"backend {jax.default_backend()}; TPU AOT {args.topology if tpu else 'unavailable'}")
    if args.int8:
        if tpu is None:
            parser.error("--int8 compiles for TPU ahead of time: install libtpu")
        int8_table(sizes, args.specs.split(","), tpu)
        return
    header = "| update | N | R | payload | CPU xla | CPU fused (blocks) | TPU xla | TPU fused |"
    if gpu:
        header += " GPU xla GB/s | GPU fused GB/s | copy GB/s |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for name in args.specs.split(","):
        spec = SPECS[name]
        for payload_dtype in (jnp.float32, jnp.bfloat16):
            for n in sizes:
                for r in (1, 2, 4, 8):
                    dtype = jnp.float32
                    minimum = api.minimum_bytes(spec, n, r, dtype, payload_dtype)
                    cpu = _bytes(_program(spec, n, r, dtype, payload_dtype, "cpu", "xla").compile())
                    fused_cpu = pipeline_bytes(spec, n, r, dtype, payload_dtype, "cpu")
                    cols = [f"{cpu / minimum:.2f}", f"{fused_cpu / minimum:.2f}"]
                    if tpu is not None:
                        for impl in ("xla", "pallas"):
                            low = _program(spec, n, r, dtype, payload_dtype, "tpu", impl, tpu)
                            try:
                                cols.append(f"{_bytes(low.compile()) / minimum:.2f}")
                            except jax.errors.JaxRuntimeError as e:  # does not fit in HBM
                                cols.append(
                                    "HBM OOM" if "RESOURCE_EXHAUSTED" in str(e) else "error"
                                )
                    else:
                        cols += ["n/a", "n/a"]
                    if gpu and n <= 10**8 * 4:
                        rates = gpu_rates(spec, n, r, dtype, payload_dtype, args.repeats)
                        cols += [f"{rates[k]:.0f}" for k in ("xla", "pallas", "copy")]
                    pd = jnp.dtype(payload_dtype).name
                    print(f"| {name} | {n:.0e} | {r} | {pd} | " + " | ".join(cols) + " |")


if __name__ == "__main__":
    main()
