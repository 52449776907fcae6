"""Compute utilization against bandwidth per algorithm, from the project's cost model.

    python -m benchmarks.utilization --overlap-slowdown 0.189 --out docs/utilization.png
    python -m benchmarks.utilization --table6      # the scaling-law paper's Table 6 only

Utilization is the fraction of a round spent computing: ``H * step_s / round_s`` with
``round_s`` from :func:`experiments.compare.simulated_round_s` (ring all-reduce between R
replicas; delayed algorithms hide the reduction behind the round and pay the overlap
slowdown; Streaming DiLoCo hides each of its P fragments behind tau steps). The settings are
stated in ``SETTINGS`` (model size, step time, H, R): assumptions that stand for the
published ones, not measurements. Prints, per setting and algorithm, the bandwidth at which
utilization reaches 95% and the utilization at chosen bandwidths, and draws the curves.

Then it reproduces the DiLoCo scaling-law paper's Table 6 (arXiv 2503.09799: the bandwidth
that DP and DiLoCo with H = 100 need for 50/80/90/95/99% compute utilization, a 10B model at
0.8 s per step) with :func:`layerwise_round_s`: each layer's reduction starts once its
backward pass is done and the link sends one layer at a time, so the reduction overlaps the
backward pass and only what is still on the wire at its end is exposed. The paper reports
the least bandwidth on a fixed grid that reaches each level (its repeated values give the
grid away: 50 log-spaced values from 0.1 to 1000 Gbit/s); the table prints the grid value,
the exact solution and the ratio to the paper's figure, and says per cell whether it is
within 10%.
"""

from __future__ import annotations

import argparse
import math

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


# Table 6 of the scaling-law paper: Gbit/s for 50/80/90/95/99% compute utilization
TABLE6_LEVELS = (0.5, 0.8, 0.9, 0.95, 0.99)
TABLE6_PAPER = {
    "DP": (104.8, 184.2, 222.3, 222.3, 390.7),
    "DiLoCo H=100": (1.4, 6.2, 13.3, 23.3, 86.8),
}
TABLE6_GRID = np.logspace(-1, 3, 50)  # Gbit/s: the grid the paper's values lie on
# the paper's setting (10B parameters, 0.8 s per step) and our assumptions for what it leaves
# unsaid: bf16 payloads, two replicas (a ring of 2 sends the payload once each way), a
# backward pass twice as long as the forward, 48 layers of equal size
TABLE6_SETTING = {
    "parameters": 10e9,
    "bytes_per_parameter": 2.0,
    "step_s": 0.8,
    "replicas": 2,
    "backward_fraction": 2 / 3,
    "layers": 48,
}


def layerwise_round_s(step_s, H, comm_s, layers, backward_fraction) -> float:
    """Seconds of one round of H steps whose last backward pass overlaps the reduction.

    The reduction of ``comm_s`` seconds is split into ``layers`` equal parts; part l can go
    on the wire when layer l's backward pass (``backward_fraction * step_s / layers``) is
    done and the previous part has been sent. The round ends when the last part arrives:
    ``f + b / L + comm`` when the link is the bottleneck (``comm >= b``), else
    ``f + b + comm / L`` (only the first layer's part is exposed). DP is ``H = 1``.
    """
    b = backward_fraction * step_s
    f = step_s - b
    last = f + (b / layers + comm_s if comm_s >= b else b + comm_s / layers)
    return (H - 1) * step_s + last


def table6_utilization(bandwidth_gbps: float, H: int, setting=TABLE6_SETTING) -> float:
    s = setting
    R = s["replicas"]
    bits = 2 * (R - 1) / R * s["parameters"] * s["bytes_per_parameter"] * 8
    comm = bits / (bandwidth_gbps * 1e9)
    round_s = layerwise_round_s(s["step_s"], H, comm, s["layers"], s["backward_fraction"])
    return H * s["step_s"] / round_s


def table6_need(level: float, H: int, setting=TABLE6_SETTING) -> tuple[float, float]:
    """(exact, on the paper's grid): the least bandwidth in Gbit/s reaching ``level``."""
    lo, hi = 1e-3, 1e5  # utilization rises with bandwidth: bisect in log space
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if table6_utilization(mid, H, setting) >= level else (mid, hi)
    on_grid = next((g for g in TABLE6_GRID if table6_utilization(g, H, setting) >= level), None)
    return hi, (math.inf if on_grid is None else float(on_grid))


def table6(setting=TABLE6_SETTING) -> list[dict]:
    """Every cell of Table 6: ours on the grid, ours exact, the paper's, the ratio, held."""
    cells = []
    for row, H in (("DP", 1), ("DiLoCo H=100", 100)):
        for level, paper in zip(TABLE6_LEVELS, TABLE6_PAPER[row], strict=True):
            exact, grid = table6_need(level, H, setting)
            ratio = grid / paper
            cells.append(
                {
                    "row": row,
                    "level": level,
                    "paper": paper,
                    "ours": grid,
                    "exact": exact,
                    "ratio": ratio,
                    "held": abs(ratio - 1) <= 0.10,
                }
            )
    return cells


def _row_matches(row: str, H: int, scale: float, setting) -> bool:
    """Whether every cell of ``row`` lands on the paper's grid value at ``scale`` x payload."""
    scaled = {**setting, "bytes_per_parameter": setting["bytes_per_parameter"] * scale}
    return all(
        abs(table6_need(u, H, scaled)[1] / paper - 1) < 0.01
        for u, paper in zip(TABLE6_LEVELS, TABLE6_PAPER[row], strict=True)
    )


def print_table6(setting=TABLE6_SETTING) -> list[dict]:
    cells = table6(setting)
    s = setting
    print(
        f"Table 6 (arXiv 2503.09799): {s['parameters'] / 1e9:.0f}B parameters, "
        f"{s['bytes_per_parameter']:g} bytes each, {s['step_s']} s per step, "
        f"{s['replicas']} replicas, {s['layers']} layers, backward {s['backward_fraction']:.2f} "
        "of a step; Gbit/s, ours on the paper's grid (exact) / the paper's"
    )
    print("| method | " + " | ".join(f"{int(100 * u)}%" for u in TABLE6_LEVELS) + " |")
    print("|---" * (1 + len(TABLE6_LEVELS)) + "|")
    for row in TABLE6_PAPER:
        mine = [c for c in cells if c["row"] == row]
        text = [
            f"{c['ours']:.1f} ({c['exact']:.1f}) / {c['paper']} = {c['ratio']:.2f}" for c in mine
        ]
        print(f"| {row} | " + " | ".join(text) + " |")
    for row, H in (("DP", 1), ("DiLoCo H=100", 100)):
        fits = [x for x in np.arange(0.30, 1.50, 0.005) if _row_matches(row, H, x, setting)]
        span = f"{min(fits):.2f}-{max(fits):.2f}" if fits else "none in 0.30-1.50"
        print(f"{row}: payload scales (x ours) that put every cell on the paper's value: {span}")
    held = sum(c["held"] for c in cells)
    verdict = "held" if held == len(cells) else "not held"
    print(f"target (every cell within 10% of the paper's): {verdict}, {held} of {len(cells)}")
    return cells


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--overlap-slowdown", type=float, default=0.189)
    parser.add_argument("--out", default="docs/utilization.png")
    parser.add_argument("--table6", action="store_true", help="only the Table 6 reproduction")
    args = parser.parse_args(argv)
    if args.table6:
        print_table6()
        return
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
    print()
    print_table6()


if __name__ == "__main__":
    main()
