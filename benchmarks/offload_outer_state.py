"""The outer state in host memory: accelerator bytes per chip with and without
``RoundTrainer(offload_outer_state=True)``, compiled ahead of time for TPU v5e.

Nothing runs or is allocated (needs ``libtpu``; the model is ``jax.ShapeDtypeStruct``): for
each algorithm the round of the benchmarks' residual MLP (d_model 2048, d_ff 8192, 30 layers:
1.0B parameters, bfloat16 parameters and optimizer state) is compiled twice in the same
process, the outer state on the device and in ``pinned_host`` memory, and
``compiled.memory_analysis()`` gives per chip:

- device bytes: arguments, temporaries and the sum with the outputs (arguments + outputs -
  aliased + temporaries: what the round needs on the chip);
- host bytes: the arguments and outputs held in host memory (the offloaded outer state);
- the outer state's bytes per chip (from its shardings), and the device bytes saved over it;
- the fraction of the replica-axis bytes in flight under compute
  (:func:`co2jax.hlo.hidden_fraction`): the round still overlaps with the outer state on
  the host.

    JAX_PLATFORMS=cpu python benchmarks/offload_outer_state.py                 # R = 2, H = 16
    JAX_PLATFORMS=cpu python benchmarks/offload_outer_state.py --replicas 4 --algorithms co2
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import time

import _common as C
import jax
import jax.numpy as jnp
from overlap_at_scale import SIZES, algorithms

import co2jax


def per_chip_bytes(tree) -> int:
    """Bytes per chip of ``ShapeDtypeStruct`` leaves, from their shardings' shard shapes."""
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
        for x in jax.tree.leaves(tree)
    )


def compile_case(outer, mesh, shapes, d_model, steps, offload, shard):
    R, D = mesh.shape["replica"], mesh.shape["data"]
    trainer = co2jax.RoundTrainer(
        C.loss_fn,
        C.inner_optimizer(),
        outer,
        mesh,
        steps,
        shard_outer_state=shard,
        offload_outer_state=offload,
    )
    batch = C.abstract_batch(mesh, R, steps, 8 * D, d_model, jnp.bfloat16)
    state = trainer.abstract_state(shapes)
    began = time.process_time()
    compiled = trainer.lower(state, batch).compile()
    seconds = time.process_time() - began
    m = compiled.memory_analysis()
    device = C.device_bytes(m)
    return {
        "argument": m.argument_size_in_bytes,
        "temp": m.temp_size_in_bytes,
        "device": device,
        "host": m.host_argument_size_in_bytes + m.host_output_size_in_bytes,
        "outer": per_chip_bytes(state.outer_state),
        "hidden": co2jax.hlo.hidden_fraction(compiled.as_text(), mesh, "replica"),
        "compile_s": seconds,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="1b", choices=sorted(SIZES))
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--topology", default="v5e:2x4")
    parser.add_argument("--steps", type=int, default=16, help="inner steps H")
    parser.add_argument("--algorithms", default="co2,delayed_diloco")
    parser.add_argument(
        "--shard-outer-state", choices=["on", "off"], default="on",
        help="split the outer state over data too (the 1B layout)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if importlib.util.find_spec("libtpu") is None:
        parser.error("needs libtpu (pip install libtpu) for ahead-of-time TPU compilation")
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(topology_name=args.topology, platform="tpu")
    R = args.replicas
    mesh = co2jax.make_mesh(replica=R, data=len(topo.devices) // R, devices=topo.devices)
    d_model, d_ff, layers = SIZES[args.size]
    shapes = C.param_shapes(d_model, d_ff, layers, jnp.bfloat16)
    cases = algorithms(shapes, args.steps)
    unknown = set(args.algorithms.split(",")) - set(cases)
    if unknown:
        parser.error(f"--algorithms: no case {sorted(unknown)[0]!r}")
    shard = args.shard_outer_state == "on"
    print(
        f"TPU AOT {args.topology} ({len(topo.devices)} chips), replica={R} x "
        f"data={mesh.shape['data']}, {C.num_params(shapes) / 1e9:.2f}B params (bf16), "
        f"H={args.steps}, outer state split over data: {shard}; GiB per chip"
    )
    gib = 2**30
    print(
        f"{'case':<16} {'offload':<8} {'outer':>7} {'args':>7} {'temp':>7} {'device':>7} "
        f"{'host':>7} {'saved':>7} {'in flight':>9} {'compile s':>9}"
    )
    for name in args.algorithms.split(","):
        rows = {}
        for offload in (False, True):
            try:
                rows[offload] = r = compile_case(
                    cases[name](), mesh, shapes, d_model, args.steps, offload, shard
                )
            except Exception as e:  # RESOURCE_EXHAUSTED: the round does not fit the chip
                first = str(e).strip().splitlines()[0][:150]
                print(f"{name:<16} {offload!s:<8} does not compile: {first}", flush=True)
                continue
            saved = rows[False]["device"] - r["device"] if False in rows else float("nan")
            print(
                f"{name:<16} {offload!s:<8} {r['outer'] / gib:>7.3f} {r['argument'] / gib:>7.3f} "
                f"{r['temp'] / gib:>7.3f} {r['device'] / gib:>7.3f} "
                f"{r['host'] / gib:>7.3f} {saved / gib:>7.3f} {r['hidden']:>9.0%} "
                f"{r['compile_s']:>9.0f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
