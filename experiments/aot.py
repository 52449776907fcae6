"""Will a config fit? Its round compiled ahead of time for a TPU topology, memory per chip.

    python -m experiments.aot --preset pod-1b --topology v5e:4x4 --slices 4
    python -m experiments.aot --preset pod-1b --topology v5e:4x4 --slices 4 \
        train.offload_outer_state=true

Builds the run's transformer, inner and outer optimizers and round engine exactly as
``experiments.train`` does, but over the devices of a TPU topology
(``jax.experimental.topologies``, one or several slices: the replica axis across slices) and
with the parameters and the batch given as ``jax.ShapeDtypeStruct`` (nothing is allocated,
no data file is read: the vocabulary is ``data.vocab_size``). Compiles one round
(``lower().compile()``, needs ``libtpu``) and prints ``memory_analysis()`` per chip: the
arguments (state and batch), the temporaries, their sum with the outputs (what the round
needs on a chip), the host memory it uses (an offloaded outer state), the chip's memory and
whether the round fits. A round that does not fit fails to compile with XLA's
``RESOURCE_EXHAUSTED``, printed in one line.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import co2jax
from experiments import checks, programs
from experiments import config as config_lib
from experiments import model as model_lib

HBM_GIB = {"v5e": 16, "v5litepod": 16, "v4": 32, "v5p": 95, "v6e": 32}
"""Memory per chip of the TPU generations a topology name starts with."""


def topology_devices(name: str, slices: int) -> list:
    """The devices of ``slices`` slices of TPU topology ``name`` (e.g. ``v5e:4x4``)."""
    from jax.experimental import topologies

    kw = {"num_slices": slices} if slices > 1 else {}
    return list(topologies.get_topology_desc(topology_name=name, platform="tpu", **kw).devices)


def compile_round(cfg, devices) -> dict:
    """The round of ``cfg`` on ``devices``, compiled: per-chip memory (bytes) and seconds."""
    m = cfg.mesh
    mesh = co2jax.make_mesh(m.replica, m.data, m.model, devices=devices)
    mcfg = programs.model_config(cfg, cfg.data.vocab_size)
    abstract = nnx.eval_shape(lambda: model_lib.Transformer(mcfg, nnx.Rngs(cfg.train.seed)))
    graphdef, params = nnx.split(abstract, nnx.Param)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    trainer, _, _ = programs.build_trainer(cfg, mesh, graphdef, params)
    R, H = mesh.shape["replica"], cfg.train.sync_every
    shape = (R, H, cfg.data.batch, cfg.data.seq_len + 1)
    batch = jax.ShapeDtypeStruct(
        shape, jnp.int32, sharding=NamedSharding(mesh, P("replica", None, "data"))
    )
    state = trainer.abstract_state(params)
    began = time.process_time()
    compiled = trainer.lower(state, batch).compile()
    seconds = time.process_time() - began
    s = compiled.memory_analysis()
    return {
        "argument": s.argument_size_in_bytes,
        "output": s.output_size_in_bytes,
        "alias": s.alias_size_in_bytes,
        "temp": s.temp_size_in_bytes,
        "device": s.argument_size_in_bytes
        + s.output_size_in_bytes
        - s.alias_size_in_bytes
        + s.temp_size_in_bytes,
        "host": s.host_argument_size_in_bytes + s.host_output_size_in_bytes,
        "params": sum(x.size for x in jax.tree.leaves(params)),  # the shapes compiled
        "mesh": dict(mesh.shape),
        "compile_s": seconds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.aot", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--preset", default="pod-1b", choices=sorted(config_lib.PRESETS))
    parser.add_argument("--config", default=None, help="a YAML/JSON config file on top")
    parser.add_argument("--topology", default="v5e:4x4", help="one slice's TPU topology")
    parser.add_argument("--slices", type=int, default=1, help="slices (the replica axis)")
    parser.add_argument("overrides", nargs="*", help="section.field=value")
    args = parser.parse_args(argv)
    if args.slices < 1:
        parser.error(f"--slices {args.slices}: must be >= 1")
    if importlib.util.find_spec("libtpu") is None:
        parser.error("needs libtpu (pip install libtpu) to compile for a TPU topology")
    try:
        try:
            cfg = checks.load(args.preset, args.overrides, args.config)
        except config_lib.ConfigError as e:  # no data file is read here: any path will do
            if "data.path" not in str(e) or any(o.startswith("data.path=") for o in args.overrides):
                raise
            unread = "data.path=(not read ahead of time)"
            cfg = checks.load(args.preset, [unread, *args.overrides], args.config)
        try:
            devices = topology_devices(args.topology, args.slices)
        except Exception as e:  # an unknown topology name: libtpu's message, in one line
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            print(f"error: --topology {args.topology}: {first}", file=sys.stderr)
            return 2
        checks.check_devices(cfg, len(devices))
    except config_lib.ConfigError as e:
        print(f"error: {' '.join(e.typed(args.overrides).splitlines())}", file=sys.stderr)
        return 2
    gib = 2**30
    hbm = HBM_GIB.get(args.topology.split(":")[0])
    print(
        f"{cfg.name}: {args.slices} x {args.topology} ({len(devices)} chips), "
        f"compiling one round ahead of time...",
        flush=True,
    )
    try:
        r = compile_round(cfg, devices)
    except Exception as e:  # does not fit (RESOURCE_EXHAUSTED) or does not compile
        print(f"does not compile: {str(e).strip().splitlines()[0][:300]}")
        return 1
    mesh = " x ".join(f"{k} {v}" for k, v in r["mesh"].items())
    print(
        f"{r['params'] / 1e9:.2f}B parameters; mesh {mesh}; compiled in {r['compile_s']:.0f} CPU-s"
    )
    print("per chip (GiB, XLA's memory_analysis of the round):")
    for name in ("argument", "output", "alias", "temp"):
        print(f"  {name:<9} {r[name] / gib:8.2f}")
    print(f"  {'device':<9} {r['device'] / gib:8.2f}  (arguments + outputs - aliased + temp)")
    print(f"  {'host':<9} {r['host'] / gib:8.2f}  (offloaded outer state, if any)")
    if hbm:
        verdict = "fits" if r["device"] <= hbm * gib else "does NOT fit"
        print(f"  {verdict} in {hbm} GiB of HBM per chip ({r['device'] / (hbm * gib):.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
