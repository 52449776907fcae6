"""Overlap at the sizes users train: what a delayed round's replica-axis bytes do on TPU.

Compiles rounds ahead of time for TPU v5e topologies, one slice or several (needs ``libtpu``;
nothing is run or allocated: the models are ``jax.ShapeDtypeStruct``) and reads the scheduled
HLO (:func:`co2jax.hlo.flights`, cross-slice megascale transfers included). For each model
size, replica count R, slice count and case (algorithm and payload) it prints

- the reducer and the chunks the engine chose (``auto``: on TPU a delayed payload in a chunk
  per inner step, each reduced inside its step, split over the replica's chips: at R = 2 an
  all-gather, from R = 3 the staged mean, scattered at its step and gathered at the next;
  ``--reducer`` forces one for every case);
- bytes one replica sends over the replica axis per round (every chip's ``sent``, ring
  algorithms: :attr:`co2jax.hlo.Flight.sent`), the part over DCN, and their ratio to a ring
  all-reduce of the uncompressed payload (2 (R-1)/R of it), to a ring all-reduce of the
  payload as its codec encodes it (the same for an exact mean) and to the engine's own model of
  the round's bytes (``RoundPlan.wire_bytes``: the codec's bytes for a compressed payload);
- the fraction of those bytes in flight under compute (an asynchronous start and done, or
  a megascale send and its done, with a loop, a matmul or a custom call between them);
- temp memory per chip and compile time (CPU seconds of ``lower().compile()``, threads
  included), each against the plain synchronous round of the same model and mesh (CO2 with
  ``reducer="pmean"``, unspread), compiled in the same process.

Models: the benchmarks' residual MLP (pre-norm blocks, layers scanned, bf16): d_model 1024,
d_ff 4096 (8.4M parameters a layer) up to 100M, and d_model 2048, d_ff 8192 (33.6M a layer)
for 1B. H = 4 inner steps unless ``--steps`` (chunks are per step; at 1B, R = 4 and H = 4
the all-gather's quarter-payload chunks were synchronous, the staged mean's are in flight);
Streaming DiLoCo: 2 fragments, 2 H steps, tau = 1 or 2 (its ratios are against
the pmean round of H steps). The outer state is split over data for 1B (``--shard-outer-state``
``on`` / ``off`` for any size; the baseline takes the same layout).

    JAX_PLATFORMS=cpu python benchmarks/overlap_at_scale.py              # 25M-100M, R = 2, 4
    JAX_PLATFORMS=cpu python benchmarks/overlap_at_scale.py --slices 2   # replicas on 2 slices
    JAX_PLATFORMS=cpu python benchmarks/overlap_at_scale.py --sizes 1b --replicas 2,4 --steps 16
    JAX_PLATFORMS=cpu python benchmarks/overlap_at_scale.py --sizes 1b --replicas 8 \
        --topology v5e:4x4
    JAX_PLATFORMS=cpu python benchmarks/overlap_at_scale.py --replicas 2,4,8,16 \
        --topology v5e:4x4 --algorithms delayed_diloco --steps 32 --reducer all_gather
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time

import _common as C
import jax
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


def algorithms(shapes, steps: int = H) -> dict:
    """Each case: (algorithm, payload) as its factory; rounds of ``steps`` inner steps
    (Streaming DiLoCo: ``2 steps``)."""
    nesterov = lambda: co2jax.outer_sgd(0.7, 0.9, nesterov=True)
    layers = shapes["w1"].shape[0]
    frags = lambda: co2jax.fragments.make_fragments(
        shapes, min(2, layers), stacked="scale|w1|b1|w2"
    )
    gather = lambda codec: comm.all_gather_compressed(codec)
    delayed = lambda reduce: co2jax.delayed_diloco(nesterov(), reduce=reduce)
    streaming = lambda tau: co2jax.streaming_diloco(nesterov(), frags(), 2 * steps, tau=tau)
    return {
        "co2": lambda: co2jax.co2(0.7, 0.5, clip_threshold=1.0),
        "delayed_diloco": lambda: co2jax.delayed_diloco(nesterov()),
        "eager_diloco": lambda: co2jax.eager_diloco(nesterov()),
        "streaming_tau2": lambda: streaming(2),
        "streaming_tau1": lambda: streaming(1),
        "delayed_int8": lambda: delayed(gather(comm.int8(block=128))),
        "delayed_int8_ef": lambda: co2jax.error_feedback(delayed(gather(comm.int8(block=128)))),
        "delayed_int8_two_step_ef": lambda: co2jax.error_feedback(
            delayed(comm.all_reduce_compressed(comm.int8(block=128)))
        ),
        "delayed_fp4": lambda: delayed(gather(comm.fp4(block=128))),
        "delayed_fp4_ef": lambda: co2jax.error_feedback(delayed(gather(comm.fp4(block=128)))),
        "delayed_topk_ef": lambda: co2jax.error_feedback(
            delayed(gather(comm.topk(64, chunk=4096))), decay=0.95
        ),
    }


def replica_bytes(flights, devices_per_replica: int) -> tuple[float, float]:
    """(all, DCN) bytes one replica sends over the replica axis per round: each of its chips
    sends ``Flight.sent`` per execution."""
    total = sum(f.sent * f.count for f in flights) * devices_per_replica
    dcn = sum(f.sent * f.count for f in flights if f.link == "dcn") * devices_per_replica
    return total, dcn


def compile_round(outer, mesh, shapes, d_model, shard, steps=H, **kw):
    R, D = mesh.shape["replica"], mesh.shape["data"]
    steps = outer.period or steps
    trainer = co2jax.RoundTrainer(
        C.loss_fn, C.inner_optimizer(), outer, mesh, steps, shard_outer_state=shard, **kw
    )
    batch = C.abstract_batch(mesh, R, steps, 8 * D, d_model, jnp.bfloat16)
    began = time.process_time()
    state = trainer.abstract_state(shapes)
    compiled = trainer.lower(state, batch).compile()
    seconds = time.process_time() - began
    mem = compiled.memory_analysis()
    total = C.device_bytes(mem)
    text = compiled.as_text()
    program = trainer.program(state)
    flights = co2jax.hlo.flights(text, mesh, "replica")
    sent, dcn = replica_bytes(flights, mesh.devices.size // R)
    payload = sum(C.num_bytes(s) for s in program.plan.payload_shapes)
    encoded = 0.0  # a ring all-reduce's bytes of the payloads as their codecs encode them
    for shapes, reducer in zip(program.plan.payload_shapes, program.plan.reducers, strict=True):
        size = sum(C.num_bytes(s) for s in jax.tree.leaves(shapes))
        if reducer.codec is not None:
            size = reducer.codec.wire_bytes(sum(s.size for s in jax.tree.leaves(shapes)))
        encoded += comm.ring_bytes(size, R)
    return {
        "reducer": program.reducer_kind,
        "chunks": [t.chunks for t in program.transfers],
        "sent": sent,
        "dcn": dcn,
        "ring": comm.ring_bytes(payload, R),
        "encoded_ring": encoded,
        "model": program.plan.wire_bytes,
        "hidden": co2jax.hlo.hidden_fraction(text, mesh, "replica"),
        "temp_gib": mem.temp_size_in_bytes / 2**30,
        "total_gib": total / 2**30,
        "compile_s": seconds,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="25m,100m")
    parser.add_argument("--replicas", default="2,4")
    parser.add_argument("--algorithms", default=",".join(algorithms(C.param_shapes(8, 8, 2))))
    parser.add_argument("--topology", default="v5e:2x4", help="one slice's topology")
    parser.add_argument("--slices", type=int, default=1, help="slices (replicas across them)")
    parser.add_argument("--steps", type=int, default=H, help="inner steps H (chunks per round)")
    parser.add_argument(
        "--shard-outer-state",
        choices=["auto", "on", "off"],
        default="auto",
        help="split the outer state over data (auto: for 1b only, where it must to fit)",
    )
    parser.add_argument(
        "--reducer",
        default="auto",
        help="the engine's reducer for every case (auto, all_gather, staged, ...)",
    )
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: must be >= 1")
    if importlib.util.find_spec("libtpu") is None:
        parser.error("needs libtpu (pip install libtpu) for ahead-of-time TPU compilation")
    unknown = set(args.algorithms.split(",")) - set(algorithms(C.param_shapes(8, 8, 2)))
    if unknown:
        parser.error(f"--algorithms: no case {sorted(unknown)[0]!r}")
    from jax.experimental import topologies

    extra = {"num_slices": args.slices} if args.slices > 1 else {}
    topo = topologies.get_topology_desc(topology_name=args.topology, platform="tpu", **extra)
    devices, rows = topo.devices, []
    print(
        f"{args.slices} x {args.topology}: {len(devices)} {devices[0].device_kind} chips, "
        f"H={args.steps}, bf16, jax {jax.__version__} (ahead-of-time compilation, nothing run)"
    )
    print(
        "| params | slices | R x D | case | reducer | chunks | sent / replica (DCN) "
        "| vs ring | vs encoded ring | vs model | in flight | temp / chip (vs pmean) "
        "| compile CPU-s (vs pmean) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for size in args.sizes.split(","):
        d_model, d_ff, layers = SIZES[size]
        shapes = C.param_shapes(d_model, d_ff, layers, jnp.bfloat16)
        for R in map(int, args.replicas.split(",")):
            D = len(devices) // R
            mesh = co2jax.make_mesh(replica=R, data=D, devices=devices)
            shard = {"on": True, "off": False}.get(args.shard_outer_state, size == "1b")
            made = algorithms(shapes, args.steps)
            base = compile_round(made["co2"](), mesh, shapes, d_model, shard, args.steps,
                                 reducer="pmean", spread=False, split_payload=False)  # fmt: skip
            for name in args.algorithms.split(","):
                head = f"| {C.num_params(shapes) / 1e6:.0f}M | {args.slices} | {R}x{D} | {name} "
                try:
                    row = compile_round(
                        made[name](), mesh, shapes, d_model, shard, args.steps, reducer=args.reducer
                    )
                except Exception as e:  # e.g. does not fit the chip
                    print(f"{head}| failed: {str(e).splitlines()[0][:120]} |", flush=True)
                    continue
                row.update(size=size, R=R, D=D, slices=args.slices, algorithm=name, base=base)
                row.update(steps=args.steps, shard_outer_state=shard)
                rows.append(row)
                print(
                    f"{head}| {row['reducer']} | {row['chunks']} "
                    f"| {C.fmt_bytes(row['sent'])} ({C.fmt_bytes(row['dcn'])}) "
                    f"| {row['sent'] / row['ring']:.2f} | {row['sent'] / row['encoded_ring']:.2f} "
                    f"| {row['sent'] / row['model']:.2f} "
                    f"| {row['hidden']:.0%} "
                    f"| {row['temp_gib']:.2f} GiB "
                    f"({row['temp_gib'] / max(base['temp_gib'], 1e-9):.2f}x) "
                    f"| {row['compile_s']:.0f} ({row['compile_s'] / base['compile_s']:.1f}x) |",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
