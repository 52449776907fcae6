"""Compute utilization against bandwidth per algorithm, from the project's cost model.

    python -m benchmarks.utilization --overlap-slowdown 0.189 --out docs/utilization.png

Utilization is the fraction of a round spent computing: ``H * step_s / round_s`` with
``round_s`` from :func:`experiments.compare.simulated_round_s` (ring all-reduce between R
replicas; delayed algorithms hide the reduction behind the round and pay the overlap
slowdown; Streaming DiLoCo hides each of its P fragments behind tau steps). The settings are
stated in ``SETTINGS`` (model size, step time, H, R): assumptions that stand for the
published ones, not measurements. Prints, per setting and algorithm, the bandwidth at which
utilization reaches 95% and the utilization at chosen bandwidths, and draws the curves.
"""

from __future__ import annotations

import argparse

import numpy as np

from experiments.compare import Link, simulated_round_s

# name: (parameters, payload bytes per parameter, step seconds, H, R, fragments, tau)
SETTINGS = {
    # Streaming DiLoCo's compute-utilization figure: a 1B model, bf16 pseudo-gradients
    # (FP4 for the streamed row), H = 100, 2 replicas, 1 s per step (assumed)
    "1B, H=100, R=2, 1 s/step": (1e9, 2.0, 1.0, 100, 2, 3, 5),
    # CO2's cluster: 80 Gbit/s TCP/IP between nodes; a 7B model, fp32 pseudo-gradients,
    # H = 12 (CO2's LLM setting), 8 replicas (nodes), 2 s per step (assumed)
    "7B, H=12, R=8, 2 s/step": (7e9, 4.0, 2.0, 12, 8, 4, 2),
}
# (label, cost-model algorithm, bytes per parameter on the wire; None: the setting's)
ROWS = [
    ("DDP", "ddp", None),
    ("DiLoCo", "diloco", None),
    ("CO2 / delayed DiLoCo", "co2", None),
    ("Streaming DiLoCo", "streaming_diloco", None),
    ("Streaming DiLoCo FP4", "streaming_diloco", 4.5 / 8),  # 4 bits + a float32 per 128
]


def utilization(algorithm, setting, bandwidth_gbps, slowdown, per_parameter=None) -> float:
    """Compute time over round time for one setting at one bandwidth."""
    n, per, step, H, R, P, tau = setting
    link = Link(bandwidth_gbps, latency_ms=0.0, overlap_slowdown=slowdown)
    payload = n * (per if per_parameter is None else per_parameter)
    return H * step / simulated_round_s(algorithm, step, H, payload, R, link, P, tau)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--overlap-slowdown", type=float, default=0.189)
    parser.add_argument("--out", default="docs/utilization.png")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bandwidths = np.logspace(-1, 3, 200)  # Gbit/s
    fig, axes = plt.subplots(1, len(SETTINGS), figsize=(6 * len(SETTINGS), 4.2), sharey=True)
    print("| setting | algorithm | Gbit/s for 95% | at 1 | at 5 | at 80 | at 100 |")
    print("|---|---|---|---|---|---|---|")
    for ax, (name, setting) in zip(np.atleast_1d(axes), SETTINGS.items(), strict=True):
        for label, algorithm, per in ROWS:
            u = [utilization(algorithm, setting, b, args.overlap_slowdown, per) for b in bandwidths]
            ax.plot(bandwidths, u, label=label)
            reach = next((b for b, x in zip(bandwidths, u, strict=True) if x >= 0.95), None)
            at = [
                utilization(algorithm, setting, b, args.overlap_slowdown, per)
                for b in (1, 5, 80, 100)
            ]
            print(
                f"| {name} | {label} | "
                + ("never" if reach is None else f"{reach:.2g}")
                + " | "
                + " | ".join(f"{x:.0%}" for x in at)
                + " |"
            )
        ax.axhline(0.95, color="k", ls=":", lw=1)
        ax.set_xscale("log")
        ax.set_xlabel("bandwidth between replicas (Gbit/s)")
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
    np.atleast_1d(axes)[0].set_ylabel("compute utilization")
    np.atleast_1d(axes)[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
