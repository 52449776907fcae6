"""Overlap at the sizes users train: what a delayed round's replica-axis bytes do on TPU.

Compiles rounds ahead of time for TPU v5e topologies (needs ``libtpu``; nothing is run or
allocated: the models are ``jax.ShapeDtypeStruct``) and reads the scheduled HLO
(:func:`co2jax.hlo.flights`). For each model size, replica count R and algorithm it prints

- the reducer and the chunks the engine chose (``auto``: on TPU a delayed payload in a chunk
  per inner step, each an all-gather issued inside its step);
- the fraction of replica-axis bytes in flight under compute (an asynchronous start and done
  with a loop, a matmul or a custom call between them), per executed byte;
- temp and total (argument + output - alias + temp) memory per chip, and compile time, each
  against the synchronous round of the same model (``reducer="pmean"``, unspread), compiled
  in the same process.

Models: the benchmarks' residual MLP (pre-norm blocks, layers scanned, bf16): d_model 1024,
d_ff 4096 (8.4M parameters a layer) up to 100M, and d_model 2048, d_ff 8192 (33.6M a layer)
for 1B. H = 4 inner steps (chunks are per step; more steps make smaller chunks); Streaming
DiLoCo: 2 fragments, H = 8, tau = 2. The pmean baseline is CO2's round with H = 4 (Streaming
DiLoCo's compile-time ratio is against that H = 4 round: its own round has twice the steps).

    JAX_PLATFORMS=cpu python benchmarks/overlap_at_scale.py              # 8M-100M, R = 2, 4, 8
    JAX_PLATFORMS=cpu python benchmarks/overlap_at_scale.py --sizes 1b --topology v5e:4x4
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time

import _common as C
import jax.numpy as jnp

import co2jax
from co2jax import comm

SIZES = {  # name: (d_model, d_ff, layers)
    "8m": (1024, 4096, 1),
    "25m": (1024, 4096, 3),
    "100m": (1024, 4096, 12),
    "1b": (2048, 8192, 30),
}
H = 4


def algorithms(shapes) -> dict:
    nesterov = lambda: co2jax.outer_sgd(0.7, 0.9, nesterov=True)
    layers = shapes["w1"].shape[0]
    frags = lambda: co2jax.fragments.make_fragments(
        shapes, min(2, layers), stacked="scale|w1|b1|w2"
    )
    int8 = comm.all_gather_compressed(comm.int8(block=128))
    return {
        "co2": lambda: co2jax.co2(0.7, 0.5, clip_threshold=1.0),
        "delayed_diloco": lambda: co2jax.delayed_diloco(nesterov()),
        "eager_diloco": lambda: co2jax.eager_diloco(nesterov()),
        # H = 8 and tau = 2: a fragment's reduction in two chunks, each inside one of the two
        # steps it overlaps (with tau = 1 XLA:TPU sinks the one chunk's all-gather into the
        # step's layer loop, synchronously: docs/overlap.md)
        "streaming_diloco": lambda: co2jax.streaming_diloco(nesterov(), frags(), 2 * H, tau=2),
        "delayed_diloco_int8": lambda: co2jax.delayed_diloco(nesterov(), reduce=int8),
    }


def compile_round(outer, mesh, shapes, d_model, shard, **kw):
    R, D = mesh.shape["replica"], mesh.shape["data"]
    steps = outer.period or H
    trainer = co2jax.RoundTrainer(
        C.loss_fn, C.inner_optimizer(), outer, mesh, steps, shard_outer_state=shard, **kw
    )
    batch = C.abstract_batch(mesh, R, steps, 8 * D, d_model, jnp.bfloat16)
    began = time.perf_counter()
    state = trainer.abstract_state(shapes)
    compiled = trainer.lower(state, batch).compile()
    seconds = time.perf_counter() - began
    mem = compiled.memory_analysis()
    total = (
        mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        - mem.alias_size_in_bytes
        + mem.temp_size_in_bytes
    )
    text = compiled.as_text()
    return {
        "reducer": trainer.program(state).reducer_kind,
        "chunks": [t.chunks for t in trainer.program(state).transfers],
        "hidden": co2jax.hlo.hidden_fraction(text, mesh, "replica"),
        "temp_gib": mem.temp_size_in_bytes / 2**30,
        "total_gib": total / 2**30,
        "compile_s": seconds,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="8m,25m,100m")
    parser.add_argument("--replicas", default="2,4,8")
    parser.add_argument("--algorithms", default=",".join(algorithms(C.param_shapes(8, 8, 2))))
    parser.add_argument("--topology", default="v5e:2x4")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("libtpu") is None:
        parser.error("needs libtpu (pip install libtpu) for ahead-of-time TPU compilation")
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(topology_name=args.topology, platform="tpu")
    devices, rows = topo.devices, []
    print(f"{args.topology}: {len(devices)} {devices[0].device_kind} chips, H={H}, bf16")
    print(
        "| params | R x D | algorithm | reducer | chunks | in flight under compute "
        "| temp / chip (vs pmean) | total / chip (vs pmean) | compile s (vs pmean) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for size in args.sizes.split(","):
        d_model, d_ff, layers = SIZES[size]
        shapes = C.param_shapes(d_model, d_ff, layers, jnp.bfloat16)
        for R in map(int, args.replicas.split(",")):
            D = len(devices) // R
            mesh = co2jax.make_mesh(replica=R, data=D, devices=devices)
            shard = size == "1b"  # a 1B outer state fits a v5e chip only split over data
            made = algorithms(shapes)
            base = compile_round(made["co2"](), mesh, shapes, d_model, shard,
                                 reducer="pmean", spread=False)  # fmt: skip
            for name in args.algorithms.split(","):
                try:
                    row = compile_round(made[name](), mesh, shapes, d_model, shard)
                except Exception as e:  # e.g. does not fit the chip
                    print(f"| {size} | {R}x{D} | {name} | failed: {str(e).splitlines()[0][:120]} |")
                    continue
                row.update(size=size, R=R, D=D, algorithm=name, base=base)
                rows.append(row)
                print(
                    f"| {C.num_params(shapes) / 1e6:.0f}M | {R}x{D} | {name} | {row['reducer']} "
                    f"| {row['chunks']} | {row['hidden']:.0%} "
                    f"| {row['temp_gib']:.2f} GiB "
                    f"({row['temp_gib'] / max(base['temp_gib'], 1e-9):.2f}x) "
                    f"| {row['total_gib']:.2f} GiB ({row['total_gib'] / base['total_gib']:.2f}x) "
                    f"| {row['compile_s']:.0f} ({row['compile_s'] / base['compile_s']:.1f}x) |",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
