"""Per-device memory of the outer state, with and without ``shard_outer_state=True``.

Part 1, emulated CPU mesh (replica=2 x data=4 by default, a small concrete model): for CO2
and DiLoCo, build the ``RoundTrainer`` state both ways, run one round, and report

- the outer state's bytes per device, summed from each array's addressable shards (the most
  loaded device), and the ratio sharded / unsharded (target 1/D, D = the data axis size;
  leaves with no dimension divisible by D stay whole);
- ``compiled.memory_analysis()`` of the round (argument, output, alias and temp bytes per
  device).

Part 2, TPU v5e ahead-of-time (needs ``libtpu``; skipped with a message otherwise): the same
round for a large model given only as ``jax.ShapeDtypeStruct`` (default about 1.0B bfloat16
parameters; nothing is allocated), compiled for a TPU topology (default ``v5e:2x4``, replica=2
x data=4) with ``jax.experimental.topologies``, printing ``memory_analysis()`` per device both
ways. A program that does not fit the chip's HBM fails to compile; the error is printed.

The TPU part uses ``--tpu-reducer pmean`` by default: the engine's automatic choice for a
delayed algorithm on TPU (``all_gather``, which overlaps with the inner loop) also works
(``--tpu-reducer auto``) but compiled 10-60x slower in our measurements (minutes per program
on 2 cores) and needs several times more temporary memory; see ``benchmarks/README.md``.

    JAX_PLATFORMS=cpu python benchmarks/outer_state_memory.py [--skip-tpu]
    JAX_PLATFORMS=cpu python benchmarks/outer_state_memory.py --topology v5e:4x4 --tpu-layers 30
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import time
from collections import defaultdict

import _common as C
import jax
import jax.numpy as jnp

import co2jax

COLUMNS = ("argument", "output", "alias", "temp")


def per_device_bytes(tree) -> int:
    """Bytes of ``tree``'s arrays on the most loaded device (from addressable shards)."""
    on = defaultdict(int)
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            on[shard.device] += shard.data.nbytes
    return max(on.values()) if on else 0


def abstract_per_device_bytes(tree) -> int:
    """Bytes per device of ``ShapeDtypeStruct`` leaves, from their shardings' shard shapes."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
    return total


def memory_row(compiled) -> dict[str, int] | None:
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return {c: getattr(stats, f"{c}_size_in_bytes") for c in COLUMNS}


def print_memory_table(rows, unit: str = "GiB") -> None:
    scale = {"GiB": 2**30, "MiB": 2**20}[unit]
    header = f"{'outer':<8} {'sharded':<8} " + " ".join(f"{c + ' ' + unit:>13}" for c in COLUMNS)
    print(header + f" {'arg+out-alias+temp':>19}")
    for name, shard, row in rows:
        if isinstance(row, str):
            print(f"{name:<8} {shard!s:<8} {row}")
            continue
        peak = row["argument"] + row["output"] - row["alias"] + row["temp"]
        cells = " ".join(f"{row[c] / scale:>13.3f}" for c in COLUMNS)
        print(f"{name:<8} {shard!s:<8} {cells} {peak / scale:>19.3f}")


def cpu_part(args) -> None:
    devices = jax.devices()[: args.replica * args.data]
    mesh = co2jax.make_mesh(replica=args.replica, data=args.data, devices=devices)
    params0 = C.init_params(jax.random.key(0), args.d_model, args.d_ff, args.layers)
    nparams = C.num_params(params0)
    print(
        f"== {devices[0].platform} mesh replica={args.replica} x data={args.data}; model "
        f"{nparams / 1e6:.2f}M params ({C.fmt_bytes(C.num_bytes(params0))} f32), "
        f"H={args.sync_every}"
    )
    batch = C.make_batch(jax.random.key(1), args.replica, args.sync_every, args.batch, args.d_model)
    sizes, memory = {}, []
    for name, make_outer in C.outer_algorithms().items():
        for shard in (False, True):
            trainer = co2jax.RoundTrainer(
                C.loss_fn,
                C.inner_optimizer(),
                make_outer(),
                mesh,
                args.sync_every,
                shard_outer_state=shard,
            )
            state = trainer.init(params0)
            compiled = trainer.lower(state, trainer.place_batch(batch)).compile()
            state, metrics = trainer.round(state, batch)  # the shardings a round returns
            jax.block_until_ready(metrics)
            sizes[name, shard] = (
                per_device_bytes(state.outer_state),
                per_device_bytes((state.params, state.inner_state)),
            )
            row = memory_row(compiled)
            memory.append((name, shard, row if row is not None else "memory_analysis() is None"))

    print(
        f"\n{'outer':<8} {'outer state/device':>19} {'sharded':>12} {'ratio':>7} "
        f"{'1/D':>6} {'params+inner/device':>20}"
    )
    for name in C.outer_algorithms():
        plain, other = sizes[name, False]
        sharded, _ = sizes[name, True]
        print(
            f"{name:<8} {C.fmt_bytes(plain):>19} {C.fmt_bytes(sharded):>12} "
            f"{sharded / plain:>7.3f} {1 / args.data:>6.3f} {C.fmt_bytes(other):>20}"
        )
    print(f"\ncompiled.memory_analysis() of the round, per device ({devices[0].platform}):")
    print_memory_table(memory, "MiB")


def tpu_part(args) -> None:
    if importlib.util.find_spec("libtpu") is None:
        print("\n== TPU AOT part skipped: libtpu is not installed (pip install libtpu).")
        return
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(topology_name=args.topology, platform="tpu")
    except Exception as e:  # libtpu present but unusable here
        print(f"\n== TPU AOT part skipped: no topology {args.topology!r}: {e}")
        return
    devices = topo.devices
    data = len(devices) // args.tpu_replica
    mesh = co2jax.make_mesh(replica=args.tpu_replica, data=data, devices=devices)
    dtype = jnp.dtype(args.tpu_dtype)
    params = C.param_shapes(args.tpu_d_model, args.tpu_d_ff, args.tpu_layers, dtype)
    batch_rows = args.tpu_batch_per_device * data
    batch = C.abstract_batch(
        mesh, args.tpu_replica, args.tpu_sync_every, batch_rows, args.tpu_d_model, dtype
    )
    print(
        f"\n== TPU AOT: {args.topology} ({len(devices)} {devices[0].device_kind} chips), mesh "
        f"replica={args.tpu_replica} x data={data}; model {C.num_params(params) / 1e9:.3f}B "
        f"params in {dtype.name} ({C.fmt_bytes(C.num_bytes(params))}), given as "
        f"ShapeDtypeStruct; H={args.tpu_sync_every}, batch {batch_rows}/replica/step, "
        f"reducer={args.tpu_reducer}"
    )
    sizes, memory = {}, []
    for name in args.tpu_algorithms:
        for shard in (False, True):
            trainer = co2jax.RoundTrainer(
                C.loss_fn,
                C.inner_optimizer(),
                C.outer_algorithms()[name](),
                mesh,
                args.tpu_sync_every,
                reducer=args.tpu_reducer,
                shard_outer_state=shard,
            )
            state = trainer.abstract_state(params)
            sizes[name, shard] = abstract_per_device_bytes(state.outer_state)
            start = time.perf_counter()
            try:
                compiled = trainer.lower(state, batch).compile()
                row = memory_row(compiled) or "memory_analysis() is None"
            except Exception as e:  # e.g. RESOURCE_EXHAUSTED: the program does not fit HBM
                row = "compile failed: " + str(e).strip().splitlines()[0][:160]
            seconds = time.perf_counter() - start
            print(
                f"  {name} shard_outer_state={shard}: "
                f"reducer {trainer.program(state).reducer_kind}, "
                f"lower+compile {seconds:.1f} s",
                flush=True,
            )
            memory.append((name, shard, row))
    print(
        f"\n{'outer':<8} {'outer state/device (from shardings)':>36} {'sharded':>12} {'ratio':>7}"
    )
    for name in args.tpu_algorithms:
        plain, sharded = sizes[name, False], sizes[name, True]
        print(
            f"{name:<8} {C.fmt_bytes(plain):>36} {C.fmt_bytes(sharded):>12} {sharded / plain:>7.3f}"
        )
    print(f"\ncompiled.memory_analysis() of the round, per {devices[0].device_kind} chip:")
    print_memory_table(memory)


def _parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replica", type=int, default=2)
    parser.add_argument("--data", type=int, default=4)
    parser.add_argument("--sync-every", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64, help="examples per replica and step")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--d-ff", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    tpu = parser.add_argument_group("TPU ahead-of-time part")
    tpu.add_argument("--skip-tpu", action="store_true")
    tpu.add_argument("--topology", default="v5e:2x4")
    tpu.add_argument("--tpu-replica", type=int, default=2)
    tpu.add_argument("--tpu-d-model", type=int, default=2048)
    tpu.add_argument("--tpu-d-ff", type=int, default=8192)
    tpu.add_argument("--tpu-layers", type=int, default=30, help="30 layers: 1.007B params")
    tpu.add_argument("--tpu-dtype", default="bfloat16")
    tpu.add_argument("--tpu-sync-every", type=int, default=4)
    tpu.add_argument("--tpu-batch-per-device", type=int, default=8)
    tpu.add_argument("--tpu-reducer", choices=co2jax.comm.policy.CHOICES, default="pmean")
    tpu.add_argument(
        "--tpu-algorithms", nargs="+", choices=list(C.outer_algorithms()), default=["co2", "diloco"]
    )
    return C.check_mesh_args(parser, parser.parse_args())


if __name__ == "__main__":
    args = _parse_args()
    cpu_part(args)
    if not args.skip_tpu:
        tpu_part(args)
