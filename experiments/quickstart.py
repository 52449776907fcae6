"""Quickstart: DDP, Local SGD, DiLoCo and CO2 side by side on an emulated 8-device CPU mesh.

4 replicas x 2 data shards each train the same small flax MLP on built-in synthetic data (a
fixed random teacher network labels Gaussian inputs; every replica and shard draws its own
stream). Every method takes the same number of inner AdamW steps. The table reports the
held-out loss of the parameters the replicas end on and the bytes each replica put into
all-reduces over the replica axis, read from the compiled program (not assumed).

    python experiments/quickstart.py [--steps 400] [--sync-every 20]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

if jax.config.jax_platforms == "cpu" and jax.config.jax_num_cpu_devices < 8:
    jax.config.update("jax_num_cpu_devices", 8)  # the emulated mesh; must precede backend start

import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import co2jax
from co2jax import hlo

REPLICA, DATA = 4, 2
D_IN, D_HIDDEN, CLASSES = 32, 64, 10
REP, SHARD = P("replica"), P("replica", "data")


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(D_IN, D_HIDDEN, rngs=rngs)
        self.l2 = nnx.Linear(D_HIDDEN, D_HIDDEN, rngs=rngs)
        self.out = nnx.Linear(D_HIDDEN, CLASSES, rngs=rngs)

    def __call__(self, x_BxD):
        return self.out(jax.nn.gelu(self.l2(jax.nn.gelu(self.l1(x_BxD)))))


def synthetic_batch(key, teacher, batch):
    """Gaussian inputs labelled by a fixed random teacher network (built-in data)."""
    x_BxD = jax.random.normal(key, (batch, D_IN))
    return x_BxD, jnp.argmax(teacher(x_BxD), axis=-1)


def default_algorithms(sync_every: int) -> dict[str, optax.GradientTransformation]:
    """The compared methods, each one optax transform around the same inner AdamW."""
    inner = optax.adamw(3e-3, weight_decay=0.01)
    nesterov = optax.sgd(0.7, momentum=0.9, nesterov=True)
    co2 = co2jax.co2(learning_rate=0.7, momentum=0.0, clip_threshold=1.0)
    return {
        "DDP": co2jax.data_parallel(inner),
        "Local SGD": co2jax.local_updates(inner, co2jax.local_sgd(), sync_every),
        "DiLoCo": co2jax.local_updates(inner, co2jax.diloco(nesterov), sync_every),
        "CO2": co2jax.local_updates(inner, co2, sync_every),
    }


def train(name, tx, mesh, graphdef, params0, teacher, steps, sync_every, batch, seed):
    """Trains one method; returns its final parameters, last losses and bytes all-reduced."""

    def loss_fn(params, x, y):
        logits = nnx.merge(graphdef, params)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def chunk(params, opt_state, keys):
        """One replica's data shard for len(keys) steps, as one lax.scan."""
        params, opt_state, keys = jax.tree.map(lambda a: a[0], (params, opt_state, keys))

        def step(carry, key):
            params, opt_state = carry
            x, y = synthetic_batch(key, teacher, batch // DATA)
            p = jax.lax.pcast(params, "data", to="varying")
            loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
            updates, opt_state = tx.update(jax.lax.pmean(grads, "data"), opt_state, params)
            loss = jax.lax.pmean(loss, "data")
            return (optax.apply_updates(params, updates), opt_state), loss

        (params, opt_state), losses = jax.lax.scan(step, (params, opt_state), keys[0])
        return jax.tree.map(lambda a: a[None], (params, opt_state, losses))

    def sharded(fn):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(REP, REP, SHARD), out_specs=REP))

    def put(tree, spec):
        return jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, spec)), tree)

    def keys_for(c):
        return put(
            jax.random.split(jax.random.key(seed + 3 + c), (REPLICA, DATA, sync_every)), SHARD
        )

    params = jax.tree.map(lambda a: jnp.stack([a] * REPLICA), params0)
    params, opt_state = put(params, REP), put(jax.vmap(tx.init)(params), REP)

    # Bytes per replica, read from the compiled one-step program: collectives outside any
    # conditional run every step; those inside a conditional branch run on sync steps only.
    one_step = sharded(lambda p, o, k: chunk(p, o, k[..., :1]))
    text = one_step.lower(params, opt_state, keys_for(0)).compile().as_text()
    branches = hlo.conditional_computations(text)
    reduced = hlo.over_axis(hlo.collectives(text), mesh, "replica")
    per_step = sum(c.bytes for c in reduced if c.computation not in branches)
    per_sync = sum(c.bytes for c in reduced if c.computation in branches)

    run_chunk = sharded(chunk)
    for c in range(steps // sync_every):
        params, opt_state, losses = run_chunk(params, opt_state, keys_for(c))
    return jax.device_get(params), losses, per_step * steps + per_sync * (steps // sync_every)


def main(steps: int, sync_every: int, batch: int, seed: int, algorithms=None) -> list[dict]:
    algorithms = default_algorithms(sync_every) if algorithms is None else algorithms
    devices = jax.devices()[: REPLICA * DATA]
    mesh = jax.make_mesh((REPLICA, DATA), ("replica", "data"), devices=devices)
    teacher = MLP(nnx.Rngs(seed + 1))
    graphdef, params0 = nnx.split(MLP(nnx.Rngs(seed)), nnx.Param)
    x_eval, y_eval = synthetic_batch(jax.random.key(seed + 2), teacher, 4096)

    @jax.jit
    def eval_loss(params):
        def one(p):
            logits = nnx.merge(graphdef, p)(x_eval)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y_eval).mean()

        return jax.vmap(one)(params).mean()

    rows = []
    for name, tx in algorithms.items():
        start = time.perf_counter()
        params, losses, nbytes = train(
            name, tx, mesh, graphdef, params0, teacher, steps, sync_every, batch, seed
        )
        rows.append(
            dict(
                algorithm=name,
                eval_loss=float(eval_loss(params)),
                train_loss=float(losses[:, -1].mean()),
                mbytes=nbytes / 1e6,
                seconds=time.perf_counter() - start,
            )
        )
        print(f"  {name:<10} done in {rows[-1]['seconds']:.1f}s", flush=True)
    return rows


def _parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--sync-every", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64, help="per replica and step")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.sync_every < 1 or args.steps < 1 or args.steps % args.sync_every:
        parser.error(
            f"--steps must be a positive multiple of --sync-every, got --steps={args.steps} "
            f"--sync-every={args.sync_every}"
        )
    if args.batch < DATA or args.batch % DATA:
        parser.error(f"--batch must be a positive multiple of {DATA}, got --batch={args.batch}")
    return args


if __name__ == "__main__":
    args = _parse_args()
    platform = jax.devices()[0].platform
    print(
        f"{REPLICA} replicas x {DATA} data shards on {jax.device_count()} {platform} devices; "
        f"{args.steps} inner steps, H={args.sync_every}"
    )
    rows = main(args.steps, args.sync_every, args.batch, args.seed)
    print(
        f"\n{'algorithm':<10} {'eval loss':>10} {'train loss':>11} {'MB all-reduced/replica':>23}"
    )
    for r in rows:
        print(
            f"{r['algorithm']:<10} {r['eval_loss']:>10.4f} {r['train_loss']:>11.4f} "
            f"{r['mbytes']:>23.3f}"
        )
