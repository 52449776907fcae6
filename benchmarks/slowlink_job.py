"""One replica job of the slow-link testbed (``benchmarks/slowlink.py`` starts R of them).

    python -m benchmarks.slowlink_job --rank 0 --peers 10.77.0.1:7100,10.77.0.2:7100 \\
        --algorithm co2 --rounds 4 --out results/slowlink/co2_0.json

Trains the cpu-tiny transformer (experiments' preset: its model, its Markov data, this
replica's stream) with :class:`co2jax.JobTrainer` and writes every round's measured
compute time, wait for the exchange, round time and bytes sent as JSON. ``ddp`` is the
per-step exchange: DiLoCo with H = 1 and outer SGD at learning rate 1 without momentum
(parameter averaging after each step; equal to averaging gradients for SGD, and the same
bytes on the link: one parameter-sized float32 payload per step).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time


def build(peers, algorithm: str, H: int, seed: int = 0):
    """``(loss_fn, inner, outer, params, streams, H)`` of the cpu-tiny testbed job (``ddp``:
    H = 1, parameter averaging); ``streams.round_batch(k)[rank]`` is a round's data."""
    import optax

    from experiments import config as config_lib
    from experiments import data as data_lib
    from experiments import model as model_lib
    from experiments import programs

    steps_per_round = H
    overrides = [f"mesh.replica={peers.replicas}", f"train.sync_every={H}", f"train.seed={seed}"]
    overrides += [f"data.seed={seed}"]  # another seed: other initial parameters and data
    if algorithm == "ddp":
        overrides += ["outer.algorithm=diloco", "outer.learning_rate=1.0", "outer.momentum=0.0"]
        overrides += ["train.sync_every=1"]
        H = 1
    else:
        overrides += [f"outer.algorithm={algorithm}"]
    if algorithm == "co2":
        overrides += ["outer.learning_rate=1.0", "outer.momentum=0.0"]
    cfg = config_lib.override(config_lib.preset("cpu-tiny"), overrides)
    streams = data_lib.make_streams(
        dataclasses.asdict(cfg.data), replicas=peers.replicas, steps_per_round=steps_per_round
    )
    mcfg = model_lib.preset(
        cfg.model.preset,
        vocab_size=streams.vocab_size,
        max_seq_len=cfg.data.seq_len,
        d_model=cfg.model.d_model,
        n_layers=cfg.model.n_layers,
        n_heads=cfg.model.n_heads,
        d_ff=cfg.model.d_ff,
        dtype=cfg.model.dtype,
    )
    graphdef, params = model_lib.init_params(mcfg, cfg.train.seed)
    loss_fn = model_lib.make_loss_fn(graphdef)
    inner = optax.adamw(cfg.inner.learning_rate, b1=cfg.inner.b1, b2=cfg.inner.b2)
    # a job has no replica axis: algorithms that need R (eager updates) are given it
    schedule = lambda t: cfg.inner.learning_rate
    outer = programs.build_outer(cfg, schedule, params, num_replicas=peers.replicas)
    return loss_fn, inner, outer, params, streams, H


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--peers", required=True, help="host:port of every job, by rank")
    parser.add_argument("--algorithm", required=True)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--sync-every", type=int, default=16)
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    import numpy as np

    import co2jax

    peers = co2jax.Peers(tuple(args.peers.split(",")), args.rank, args.timeout_s, args.latency_ms)
    loss_fn, inner, outer, params, streams, H = build(peers, args.algorithm, args.sync_every)
    trainer = co2jax.JobTrainer(loss_fn, inner, outer, peers, H)
    state = trainer.init(params)
    rows = []
    # a DDP "round" is the same H_testbed steps as the others': H exchanges of one step each
    steps = args.sync_every // H
    for k in range(args.rounds + 1):  # round 0 compiles: reported apart
        tokens = streams.round_batch(k)[args.rank]  # [H_testbed, B, L + 1]
        began = time.perf_counter()
        compute = wait = sent = 0.0
        for s in range(steps):
            state, m = trainer.round(state, tokens[s * H : (s + 1) * H])
            compute, wait, sent = compute + m.compute_s, wait + m.wait_s, sent + m.bytes_sent
        rows.append(
            {
                "round": k,
                "round_s": time.perf_counter() - began,
                "compute_s": compute,
                "wait_s": wait,
                "bytes_sent": sent,
                "loss": float(np.mean(np.asarray(m.losses))),
            }
        )
    payload_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    with open(args.out, "w") as f:
        json.dump(
            {
                "algorithm": args.algorithm,
                "rank": args.rank,
                "replicas": peers.replicas,
                "sync_every": args.sync_every,
                "payload_bytes": payload_bytes,
                "overlapped": outer.overlapped,
                "rows": rows,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
