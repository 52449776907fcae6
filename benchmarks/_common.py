"""Shared pieces of the benchmarks: emulated devices, a residual-MLP model and a timer.

Import this module before anything else imports JAX's backend: on CPU it asks for 8 emulated
devices, which only takes effect before the backend starts.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

if jax.config.jax_platforms == "cpu" and jax.config.jax_num_cpu_devices < 8:
    jax.config.update("jax_num_cpu_devices", 8)  # must precede backend start

import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import co2jax


def param_shapes(d_model: int, d_ff: int, layers: int, dtype=jnp.float32) -> dict:
    """``jax.ShapeDtypeStruct`` leaves of the model (layers stacked on a leading axis)."""
    s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
    return {
        "scale": s(layers, d_model),
        "w1": s(layers, d_model, d_ff),
        "b1": s(layers, d_ff),
        "w2": s(layers, d_ff, d_model),
    }


def num_params(shapes) -> int:
    return sum(x.size for x in jax.tree.leaves(shapes))


def num_bytes(shapes) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(shapes))


def init_params(key, d_model: int, d_ff: int, layers: int, dtype=jnp.float32) -> dict:
    """Concrete parameters of :func:`param_shapes` (only for models that fit in memory)."""
    k1, k2 = jax.random.split(key)
    return {
        "scale": jnp.ones((layers, d_model), dtype),
        "w1": (jax.random.normal(k1, (layers, d_model, d_ff)) / d_model**0.5).astype(dtype),
        "b1": jnp.zeros((layers, d_ff), dtype),
        "w2": (jax.random.normal(k2, (layers, d_ff, d_model)) / d_ff**0.5).astype(dtype),
    }


def loss_fn(params: dict, batch: dict) -> jax.Array:
    """A stack of pre-norm residual MLP blocks (a transformer without attention), MSE loss.

    ``batch["x"]`` and ``batch["y"]`` are ``[B, d_model]``; the layers run as one
    ``lax.scan`` so the program size does not grow with depth.
    """

    def block(h, layer):
        norm = h * jax.lax.rsqrt(jnp.mean(jnp.square(h), axis=-1, keepdims=True) + 1e-6)
        hidden = jax.nn.gelu(norm * layer["scale"] @ layer["w1"] + layer["b1"])
        return h + hidden @ layer["w2"], None

    h, _ = jax.lax.scan(block, batch["x"].astype(params["w1"].dtype), params)
    return jnp.mean(jnp.square(h.astype(jnp.float32) - batch["y"].astype(jnp.float32)))


def make_batch(key, replicas: int, steps: int, batch: int, d_model: int, dtype=jnp.float32):
    """A ``[replica, H, batch, d_model]`` regression batch (the round engine's layout)."""
    kx, ky = jax.random.split(key)
    shape = (replicas, steps, batch, d_model)
    return {
        "x": jax.random.normal(kx, shape, dtype),
        "y": jax.random.normal(ky, shape, dtype),
    }


def abstract_batch(mesh, replicas, steps, batch, d_model, dtype=jnp.float32):
    """``ShapeDtypeStruct`` batch sharded like :meth:`RoundTrainer.place_batch` does."""
    sharding = NamedSharding(mesh, P(co2jax.REPLICA, None, co2jax.DATA))
    leaf = jax.ShapeDtypeStruct(
        (replicas, steps, batch, d_model), jnp.dtype(dtype), sharding=sharding
    )
    return {"x": leaf, "y": leaf}


def outer_algorithms() -> dict[str, Callable[[], co2jax.OuterOptimizer]]:
    """The outer optimizers the benchmarks compare (the papers' defaults)."""
    return {
        "co2": lambda: co2jax.co2(learning_rate=0.7, momentum=0.5, clip_threshold=1.0),
        "diloco": lambda: co2jax.diloco(optax.sgd(0.7, momentum=0.9, nesterov=True)),
    }


def inner_optimizer() -> optax.GradientTransformation:
    return optax.adamw(4e-4, b1=0.9, b2=0.95, weight_decay=0.1)


def time_calls(run: Callable[[], object], reps: int, warmup: int = 2) -> list[float]:
    """Seconds of each of ``reps`` calls of ``run`` (blocked on), after ``warmup`` calls."""
    for _ in range(warmup):
        jax.block_until_ready(run())
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - start)
    return times


def median(xs) -> float:
    return statistics.median(xs)


def device_bytes(stats) -> int:
    """What a compiled program needs on a device, from ``memory_analysis()``: arguments +
    outputs - aliased + temporaries."""
    return (
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
        + stats.temp_size_in_bytes
    )


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def check_mesh_args(parser, args):
    """Rejects a batch the data axis does not divide, or a mesh larger than the devices."""
    if args.batch % args.data:
        parser.error(f"--batch must be a multiple of --data, got {args.batch} and {args.data}")
    if args.replica * args.data > jax.device_count():
        parser.error(f"replica x data must be <= {jax.device_count()} devices")
    return args
