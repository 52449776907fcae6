"""The comparison report: every algorithm on the same tokens, one table and three plots.

    python -m experiments.compare --preset cpu-tiny

Runs the preset once per algorithm (DDP, Local SGD, DiLoCo, naive delayed DiLoCo, eager
DiLoCo, CO2 without and with penalty and clip, DiLoCo with int8 pseudo-gradients, Streaming
DiLoCo in float32 and FP4, SparseLoCo) on the emulated 8-device CPU mesh (4 replicas x
2 data shards), then writes ``results/<preset>/report.md`` with the table (final eval loss,
excess over the data's entropy floor, bytes sent per replica, ratio to DDP, tokens/s,
simulated wall clock) and PNG plots of loss against tokens, bytes and simulated wall clock.

The simulated wall clock combines the measured compute time per inner step with a cost model
of the link between replicas: a ring all-reduce of N bytes over R replicas costs
``2 (R-1)/R * N * 8 / bandwidth + 2 (R-1) * latency``. Synchronous algorithms wait for it; an
algorithm whose reduction is overlapped (sent before the round's inner steps) hides it behind
the round's compute, up to that compute, and slows the overlapped compute by
``overlap_slowdown`` (18.9% on average measured on A100/H100/MI250, arXiv 2507.03114).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from co2jax.algorithms import registry
from experiments import config as config_lib
from experiments import train

# (label, overrides): every run sees the same tokens (same rounds, H, batch, seq_len, seed)
SWEEP = [
    ("DDP", ["outer.algorithm=ddp"]),
    ("Local SGD", ["outer.algorithm=local_sgd"]),
    ("DiLoCo", ["outer.algorithm=diloco"]),
    ("Delayed DiLoCo (naive)", ["outer.algorithm=delayed_diloco"]),
    ("Eager DiLoCo", ["outer.algorithm=eager_diloco"]),
    # the paper's ablation: a naive delay with a lower outer learning rate (and eager alike)
    (
        "Delayed DiLoCo (outer lr 0.35)",
        ["outer.algorithm=delayed_diloco", "outer.learning_rate=0.35"],
    ),
    ("Eager DiLoCo (outer lr 0.35)", ["outer.algorithm=eager_diloco", "outer.learning_rate=0.35"]),
    ("CO2", ["outer.algorithm=co2", "outer.learning_rate=1.0", "outer.momentum=0.0"]),
    (
        "CO2 + penalty + clip",
        [
            "outer.algorithm=co2",
            "outer.learning_rate=1.0",
            "outer.momentum=0.2",
            "outer.penalty=gap_aware",
            "outer.clip_threshold=0.02",
        ],
    ),
    # fragments, compressed pseudo-gradients, sparse error feedback. Streaming DiLoCo uses
    # DiLoCo's outer optimizer and alpha = 0 (the paper's alpha 0.5 with outer lr 0.4 was
    # 0.02 worse here); FP4 goes through the two-step collective (2 (R-1)/R encoded
    # payloads per replica). SparseLoCo: lr 1, top 32 of 4096, 2-bit values (ALGORITHMS.md).
    ("DiLoCo int8", ["outer.algorithm=diloco", "outer.compression=int8"]),
    ("Streaming DiLoCo", ["outer.algorithm=streaming_diloco", "outer.alpha=0.0"]),
    (
        "Streaming DiLoCo FP4",
        [
            "outer.algorithm=streaming_diloco",
            "outer.alpha=0.0",
            "outer.compression=fp4",
            "outer.collective=two_step",
        ],
    ),
    ("SparseLoCo", ["outer.algorithm=sparseloco", "outer.learning_rate=1.0"]),
]
# --sweep compression: the rows that compare bandwidth (run it with a larger H, see docs)
COMPRESSION = [
    "DDP",
    "DiLoCo",
    "DiLoCo int8",
    "Streaming DiLoCo",
    "Streaming DiLoCo FP4",
    "SparseLoCo",
]

PUBLISHED = """\
Published ordering (ALGORITHMS.md; Kale, Douillard, Donchev, arXiv 2502.12996, Table 2, 500M
model, H=30): no overlap (DiLoCo) 2.67 eval loss; naive one-outer-step delay 3.01 (2.73 with a
lower outer learning rate); eager updates 2.69. DiLoCo (arXiv 2311.08105): 8 replicas match
fully synchronous training while communicating 500x less. Streaming DiLoCo (arXiv 2501.18512):
400x fewer bits than data parallel at equal quality with FP4 (1B, Dolma). SparseLoCo (arXiv
2508.15706): 1-3% density with 2-bit values beats full-precision DiLoCo."""


@dataclasses.dataclass(frozen=True)
class Link:
    bandwidth_gbps: float = 1.0
    latency_ms: float = 10.0
    overlap_slowdown: float = 0.189

    def allreduce_s(self, nbytes: float, replicas: int) -> float:
        if replicas <= 1 or nbytes <= 0:
            return 0.0
        ring = 2 * (replicas - 1) / replicas * nbytes * 8 / (self.bandwidth_gbps * 1e9)
        return ring + 2 * (replicas - 1) * self.latency_ms / 1e3

    def exchange_s(self, nbytes: float, replicas: int) -> float:
        """Every replica sends its whole payload to each of the R-1 others over its own link
        (the multi-job exchange, ``co2jax.multijob``): ``(R-1) N`` bytes up each link, and
        one latency per peer pulled in turn."""
        if replicas <= 1 or nbytes <= 0:
            return 0.0
        up = (replicas - 1) * nbytes * 8 / (self.bandwidth_gbps * 1e9)
        return up + (replicas - 1) * self.latency_ms / 1e3


def simulated_round_s(
    algorithm: str,
    step_s: float,
    H: int,
    payload_bytes: float,
    R: int,
    link: Link,
    fragments: int = 1,
    tau: int = 0,
    exchange: str = "ring",
    overlapped: bool | None = None,
) -> float:
    """Simulated seconds of one round (H inner steps and the sync): the project's cost model.

    ``exchange`` is how a payload crosses the link: ``"ring"`` (an in-program ring
    all-reduce, :meth:`Link.allreduce_s`) or ``"all_to_all"`` (the multi-job exchange,
    :meth:`Link.exchange_s`). A synchronous algorithm waits for it; a delayed one
    (the registry's ``delayed`` capability, or ``overlapped`` as a run recorded it) hides it
    behind the round's compute, up to that compute, which it slows by
    ``link.overlap_slowdown``. An algorithm that syncs fragments (Streaming DiLoCo) sends
    ``fragments`` reductions of ``payload_bytes / fragments`` each, and each one hides behind
    ``tau`` inner steps. One that communicates every step (DDP) pays the cost every step.
    """
    caps = registry.REGISTRY[algorithm].capabilities
    overlapped = caps.delayed if overlapped is None else overlapped
    if exchange not in ("ring", "all_to_all"):
        raise ValueError(f"exchange must be 'ring' or 'all_to_all', got exchange={exchange!r}")
    cost = link.allreduce_s if exchange == "ring" else link.exchange_s
    compute = H * step_s
    if caps.every_step:
        return H * (step_s + cost(payload_bytes, R))
    if caps.fragments:
        comm = cost(payload_bytes / fragments, R)
        hidden = min(comm, tau * step_s)
        return compute + fragments * (link.overlap_slowdown * hidden + comm - hidden)
    comm = cost(payload_bytes, R)
    if overlapped:
        hidden = min(comm, compute)
        return compute + link.overlap_slowdown * hidden + (comm - hidden)
    return compute + comm


def run_sweep(
    base: config_lib.Config, out: Path, link: Link, sweep=SWEEP, seeds: int = 1
) -> list[dict]:
    """One row per entry of ``sweep``. With ``seeds > 1`` each entry also runs with
    ``train.seed`` + 1, + 2, ...: the row keeps the first seed's curves and reports the final
    eval loss's mean and seed-to-seed standard deviation."""
    rows = []
    for label, overrides in sweep:
        losses, row = [], None
        for k in range(seeds):
            seed = base.train.seed + k
            name = f"{base.name}-{_slug(label)}" + (f"-seed{seed}" if k else "")
            cfg = config_lib.override(base, [*overrides, f"name={name}", f"train.seed={seed}"])
            began = time.perf_counter()
            run_dir = out / "runs" / (_slug(label) + (f"-seed{seed}" if k else ""))
            result = train.train(cfg, out_dir=str(run_dir))
            elapsed = time.perf_counter() - began
            losses.append(result.history[-1]["eval_loss"])
            if row is None:
                row = _summarise(label, cfg, result.history, result.entropy_rate, link, elapsed)
        row["seed_losses"] = losses
        row["eval_loss"] = float(np.mean(losses))
        row["eval_std"] = float(np.std(losses, ddof=1)) if seeds > 1 else None
        if row["entropy"] is not None:
            row["excess"] = row["eval_loss"] - row["entropy"]
        rows.append(row)
        spread = "" if seeds == 1 else f" +- {row['eval_std']:.4f} ({seeds} seeds)"
        print(f"  {label:<24} eval {row['eval_loss']:.4f}{spread}  ({row['run_s']:.0f}s)")
    return rows


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in label.lower()).strip("-")


def _summarise(label, cfg, history, entropy, link, run_s) -> dict:
    R, H = cfg.mesh.replica, cfg.train.sync_every
    steady = [r["seconds"] for r in history[1:]] or [history[0]["seconds"]]
    step_s = float(np.median(steady)) / H  # round 1 includes compilation
    per_round = history[-1]["bytes_total"] / len(history)
    # payload bytes per reduction, from the ring traffic 2(R-1)/R * N per replica
    reductions = H if registry.REGISTRY[cfg.outer.algorithm].capabilities.every_step else 1
    payload = per_round / reductions / (2 * (R - 1) / R) if R > 1 else 0.0
    sim = simulated_round_s(
        cfg.outer.algorithm,
        step_s,
        H,
        payload,
        R,
        link,
        cfg.outer.fragments,
        cfg.outer.tau,
        overlapped=history[-1].get("overlapped"),
    )
    evals = [(r["tokens"], r["eval_loss"]) for r in history if "eval_loss" in r]
    return {
        "label": label,
        "algorithm": cfg.outer.algorithm,
        "eval_loss": history[-1]["eval_loss"],
        "excess": None if entropy is None else history[-1]["eval_loss"] - entropy,
        "entropy": entropy,
        "bytes_total": history[-1]["bytes_total"],
        "tokens": history[-1]["tokens"],
        "tokens_per_s": history[-1]["tokens"] / (step_s * H * len(history)),
        "sim_s": sim * len(history),
        "run_s": run_s,
        "curve_tokens": [t for t, _ in evals],
        "curve_loss": [v for _, v in evals],
        "curve_bytes": [r["bytes_total"] for r in history if "eval_loss" in r],
        "curve_sim_s": [sim * r["round"] for r in history if "eval_loss" in r],
    }


def write_report(rows: list[dict], base: config_lib.Config, out: Path, link: Link) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    ddp = next((r for r in rows if r["algorithm"] == "ddp"), None)
    plots = []
    for key, xlabel, name, log in [
        ("curve_tokens", "tokens", "loss_vs_tokens.png", False),
        ("curve_bytes", "bytes sent per replica", "loss_vs_bytes.png", True),
        ("curve_sim_s", "simulated wall clock (s)", "loss_vs_wallclock.png", False),
    ]:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for i, r in enumerate(rows):
            xs = np.maximum(np.asarray(r[key], dtype=float), 1.0) if log else r[key]
            style = "-" if i < 10 else "--"  # the default cycle has 10 colours
            ax.plot(xs, r["curve_loss"], style, marker="o", ms=3, label=r["label"])
        if rows and rows[0]["entropy"] is not None:
            ax.axhline(rows[0]["entropy"], color="k", ls=":", lw=1, label="entropy floor")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("eval loss (nats/token)")
        if log:
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        plots.append(name)

    seeds = len(rows[0].get("seed_losses", [None])) if rows else 1
    lines = [
        f"# co2jax comparison: {base.name}",
        "",
        f"{base.mesh.replica} replicas x {base.mesh.data} data shards, H={base.train.sync_every},"
        f" {base.train.rounds} rounds, {rows[0]['tokens']:,} training tokens per run; "
        f"data `{base.data.kind}`"
        + (f" (entropy floor {rows[0]['entropy']:.4f} nats/token)" if rows[0]["entropy"] else "")
        + ".",
        f"Simulated link: {link.bandwidth_gbps} Gbit/s, {link.latency_ms} ms latency, overlap "
        f"slows compute by {link.overlap_slowdown:.1%}."
        + (
            f" Eval loss: mean ± standard deviation over {seeds} seeds (the other columns:"
            " the first seed)."
            if seeds > 1
            else " One seed per algorithm (`--seeds N` for the seed-to-seed spread)."
        ),
        "",
        "| algorithm | eval loss | excess over entropy | MB sent / replica | vs DDP | tokens/s "
        "(measured) | simulated wall clock (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        excess = "n/a" if r["excess"] is None else f"{r['excess']:.4f}"
        ratio = (
            f"{r['bytes_total'] / ddp['bytes_total']:.4f}" if ddp and ddp["bytes_total"] else "n/a"
        )
        loss = f"{r['eval_loss']:.4f}"
        if r.get("eval_std") is not None:
            loss += f" ± {r['eval_std']:.4f}"
        lines.append(
            f"| {r['label']} | {loss} | {excess} | {r['bytes_total'] / 1e6:.2f} "
            f"| {ratio} | {r['tokens_per_s']:,.0f} | {r['sim_s']:.1f} |"
        )
    lines += ["", PUBLISHED, "", *[f"![{p}]({p})" for p in plots], ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="co2jax comparison report")
    parser.add_argument("--preset", default="cpu-tiny", choices=sorted(config_lib.PRESETS))
    parser.add_argument("--out", default=None, help="default: results/<preset>")
    parser.add_argument("--bandwidth-gbps", type=float, default=1.0)
    parser.add_argument("--latency-ms", type=float, default=10.0)
    parser.add_argument("--overlap-slowdown", type=float, default=0.189)
    parser.add_argument(
        "--seeds", type=int, default=1, help="runs per algorithm (train.seed, +1, ...)"
    )
    parser.add_argument(
        "--sweep",
        default="all",
        choices=["all", "compression"],
        help="all: every algorithm; compression: DDP, DiLoCo and the compressed/streamed rows",
    )
    parser.add_argument("overrides", nargs="*", help="section.field=value, for every run")
    args = parser.parse_args(argv)
    for name, value in [
        ("--bandwidth-gbps", args.bandwidth_gbps),
        ("--latency-ms", args.latency_ms),
    ]:
        if not value > 0:
            parser.error(f"{name} must be > 0, got {value}")
    if args.seeds < 1:
        parser.error(f"--seeds must be >= 1, got {args.seeds}")
    base = config_lib.override(
        config_lib.preset(args.preset), ["log.progress=false", *args.overrides]
    )
    config_lib.validate(base)
    out = Path(args.out or f"results/{args.preset}")
    link = Link(args.bandwidth_gbps, args.latency_ms, args.overlap_slowdown)
    sweep = SWEEP if args.sweep == "all" else [e for e in SWEEP if e[0] in COMPRESSION]
    print(f"co2jax compare: preset {args.preset}, {len(sweep)} runs, writing {out}/report.md")
    rows = run_sweep(base, out, link, sweep=sweep, seeds=args.seeds)
    path = write_report(rows, base, out, link)
    print(path.read_text().split("\n\n")[2])
    print(f"report: {path}")


if __name__ == "__main__":
    main()
