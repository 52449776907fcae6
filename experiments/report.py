"""The comparison's report: ``report.md`` (the table, labelled with the devices its times
were measured on, each row's overrides and outer hyper-parameters, each published claim
held or not held with its numbers, the published ordering), ``summary.json``, the three PNG
plots (styles that tell up to 40 rows apart, the informative y range) and the sweep's
progress lines.

Reads the rows :mod:`experiments.compare` builds; every file is replaced whole (written to a
temporary sibling, then renamed), so an interrupted sweep leaves a valid partial report.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np

from experiments import config as config_lib
from experiments.files import save_figure, write_atomic
from experiments.sweep_rows import Link

REPO = Path(__file__).resolve().parents[1]

PUBLISHED = """\
Published ordering (docs/algorithms/delayed_diloco.md, docs/algorithms/eager_diloco.md; Kale,
Douillard, Donchev, arXiv 2502.12996, Table 2, 500M model, H=30): no overlap (DiLoCo) 2.67
eval loss; naive one-outer-step delay 3.01 (2.73 with a lower outer learning rate); eager
updates 2.69. DiLoCo (arXiv 2311.08105): 8 replicas match fully synchronous training while
communicating 500x less. Streaming DiLoCo (arXiv 2501.18512): 400x fewer bits than data
parallel at equal quality with FP4 (1B, Dolma). SparseLoCo (arXiv 2508.15706): 1-3% density
with 2-bit values beats full-precision DiLoCo."""

# Each published claim the sweep can check: (what the paper says, the rows it compares, the
# check). Losses "match" within MATCH of each other (relative), the tolerance stated in the
# report.
MATCH = 0.01
CLAIMS = [
    (
        "Eager updates recover DiLoCo's loss and beat the naive one-step delay (arXiv "
        "2502.12996 Table 2: DiLoCo 2.67 <= eager 2.69 < naive delayed 3.01)",
        ("DiLoCo", "Eager DiLoCo", "Delayed DiLoCo (naive)"),
        lambda d, e, n: e < n and e <= d * (1 + MATCH),
    ),
    (
        "A lower outer learning rate rescues the naive delay (the same table: 3.01 -> 2.73)",
        ("Delayed DiLoCo (naive)", "Delayed DiLoCo (outer lr 0.35)"),
        lambda n, low: low < n,
    ),
    (
        "DiLoCo matches fully synchronous training (arXiv 2311.08105)",
        ("DDP", "DiLoCo"),
        lambda ddp, d: d <= ddp * (1 + MATCH),
    ),
    (
        "CO2 reaches synchronous training's loss (arXiv 2401.16265)",
        ("DDP", "CO2"),
        lambda ddp, c: c <= ddp * (1 + MATCH),
    ),
    (
        "Streaming DiLoCo with FP4 matches data parallel (arXiv 2501.18512)",
        ("DDP", "Streaming DiLoCo FP4"),
        lambda ddp, s: s <= ddp * (1 + MATCH),
    ),
    (
        "SparseLoCo (1-3% density, 2-bit values) beats DiLoCo (arXiv 2508.15706)",
        ("DiLoCo", "SparseLoCo"),
        lambda d, s: s < d,
    ),
]


def verdicts(rows: list[dict]) -> list[str]:
    """One line per published claim (:data:`CLAIMS`): ``held`` or ``not held`` with the rows'
    eval losses. A diverged (or non-finite) row counts as worse than any finite loss (+inf),
    so an ordering it is on the losing side of can still hold; a claim cannot be judged here
    when a row is not in the sweep, failed, or when every row of it diverged."""
    by_label = {r["label"]: r for r in rows}
    out = []
    for claim, labels, check in CLAIMS:
        found = [by_label.get(label) for label in labels]
        missing = [lab for lab, r in zip(labels, found, strict=True) if r is None]
        if missing:
            out.append(f"- {claim}: not in this sweep ({', '.join(missing)} not run)")
            continue
        failed = [r for r in found if r.get("status") != "done"]
        if failed or all(r.get("flag") for r in found):
            why = ", ".join(
                f"{r['label']} {r.get('status') if r in failed else r.get('flag')}"
                for r in failed or found
            )
            out.append(f"- {claim}: cannot be judged ({why})")
            continue
        losses = [math.inf if r.get("flag") else r["eval_loss"] for r in found]
        shown = ", ".join(
            f"{r['label']} {r['flag']}" if r.get("flag") else f"{r['label']} {v:.4f}"
            for r, v in zip(found, losses, strict=True)
        )
        out.append(f"- {claim}: **{'held' if check(*losses) else 'not held'}** ({shown})")
    return out


def device_label() -> str:
    """Where this process computes, as the report's measured columns say it: the platform,
    the device count, and for CPU that the devices are emulated on one host."""
    import jax

    devices = jax.devices()
    if devices[0].platform == "cpu":
        return f"{len(devices)} CPU-emulated devices on one host (not accelerators)"
    return f"{len(devices)} x {devices[0].device_kind}"


PLOTS = [
    ("curve_tokens", "tokens", "loss_vs_tokens.png", False),
    ("curve_bytes", "bytes sent per replica", "loss_vs_bytes.png", True),
    (
        "curve_sim_s",
        "modelled wall clock (s; compute as measured here)",
        "loss_vs_wallclock.png",
        False,
    ),
]


def progress_line(row: dict, seeds: int) -> str:
    """The console line for a row once it has run (or failed, or been reused)."""
    label = f"  {row['label']:<30}"
    if row["status"] == "failed":
        return f"{label} FAILED: {row['error']}"
    spread = "" if seeds == 1 else f" +- {row['eval_std']:.4f} ({seeds} seeds)"
    how = "reused" if not row["ran"] else f"{row['run_s']:.0f}s"
    flag = f" [{row['flag']}]" if row.get("flag") else ""
    return f"{label} eval {row['eval_loss']:.4f}{spread}  ({how}){flag}"


def exit_status(rows: list[dict]) -> int:
    """The sweep's exit code: 1 (failed rows named on stderr) when any row failed, else 0."""
    failed = [r["label"] for r in rows if r["status"] == "failed"]
    if failed:
        print(f"co2jax compare: {len(failed)} row(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def format_ratio(x: float | None) -> str:
    """A ratio to DDP as people read it: ``1/16`` for 0.0625, ``1/1.9`` for 0.53, ``1`` for
    1, ``2.5`` above 1, ``0`` for nothing sent, ``n/a`` without a DDP row."""
    if x is None or not math.isfinite(x) or x < 0:
        return "n/a"
    if x == 0:
        return "0"
    if x >= 1:
        return f"{x:.3g}"
    n = 1 / x
    return f"1/{n:.2g}" if n < 9.95 else f"1/{round(n):,}"


LINESTYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P", "X")


def plot_styles(n: int) -> list[tuple[str, str, str]]:
    """``(colour, line style, marker)`` per row, no (colour, line style) pair repeated.

    Up to 40 rows: the 10 colours of matplotlib's default cycle, the line style stepping with
    the row and with each pass over the colours (row i: colour i mod 10, style (i + i // 10)
    mod 4, so the 4 passes give each colour 4 different styles). Beyond 40, every row its own
    colour from a continuous colour map."""
    if n <= len(LINESTYLES) * 10:
        colours = [f"C{i % 10}" for i in range(n)]
        styles = [LINESTYLES[(i + i // 10) % len(LINESTYLES)] for i in range(n)]
    else:
        import matplotlib

        cmap = matplotlib.colormaps["gist_rainbow"]
        colours = [matplotlib.colors.to_hex(cmap(i / n)) for i in range(n)]
        styles = [LINESTYLES[i % len(LINESTYLES)] for i in range(n)]
    return [
        (c, s, MARKERS[i % len(MARKERS)])
        for i, (c, s) in enumerate(zip(colours, styles, strict=True))
    ]


def y_limits(rows: list[dict]) -> tuple[float, float] | None:
    """The informative band of eval loss, from the finished, finite, non-diverged rows only
    (diverged and non-finite rows do not move it): from their lowest point to their worst
    final loss plus twice the spread of the final losses (at least 5% of the worst), capped
    at their highest point; extended down to the entropy floor when that at most doubles the
    band; padded by 5%."""
    good = [r for r in rows if r.get("status") == "done" and not r.get("flag")]
    if not good:
        return None
    points = [float(v) for r in good for v in r["curve_loss"]]
    finals = [float(r["curve_loss"][-1]) for r in good]
    lo, best, worst = min(points), min(finals), max(finals)
    hi = min(max(points), worst + max(2 * (worst - best), 0.05 * abs(worst), 1e-3))
    hi = max(hi, worst)
    floor = _entropy(rows)
    if floor is not None and lo - (hi - lo) <= floor < lo:
        lo = floor
    pad = 0.05 * (hi - lo) if hi > lo else max(0.05 * abs(lo), 1e-3)
    return lo - pad, hi + pad


def _entropy(rows: list[dict]) -> float | None:
    floors = [r.get("entropy") for r in rows if r.get("status") == "done"]
    floors = [float(f) for f in floors if f is not None and math.isfinite(f)]
    return floors[0] if floors else None


FAMILIES = (
    (
        "synchronous and periodic",
        ("ddp", "local_sgd", "slowmo", "diloco", "desloc", "hierarchical_diloco"),
    ),
    ("delayed and eager", ("delayed_diloco", "eager_diloco", "co2", "cocodc")),
    ("streaming", ("streaming_diloco",)),
    (
        "compressed, sparse and gossip",
        (
            "sparseloco",
            "demo",
            "dct_diloco",
            "diloco_x",
            "noloco",
            "sparta",
            "sparta_diloco",
            "muloco",
        ),
    ),
)
"""The plots' facets: each row in its algorithm's family, a compressed payload
(``outer.compression``) among the compressed; any other algorithm in a facet of its own."""
REFERENCES = ("ddp", "diloco")  # drawn in grey in the other facets, to compare against


def family(row: dict) -> str:
    """The facet of ``row`` (:data:`FAMILIES`)."""
    compressed = any(
        o.startswith("outer.compression=") and not o.endswith("=none")
        for o in row.get("overrides", ())
    )
    if compressed:
        return FAMILIES[-1][0]
    for name, algorithms in FAMILIES:
        if row.get("algorithm") in algorithms:
            return name
    return str(row.get("algorithm", "other"))


def _references(rows: list[dict]) -> list[dict]:
    """The first finished plain DDP and DiLoCo rows (no compression)."""
    found = {}
    for r in rows:
        a = r.get("algorithm")
        if a in REFERENCES and a not in found and r.get("status") == "done":
            if family(r) == FAMILIES[0][0]:
                found[a] = r
    return [found[a] for a in REFERENCES if a in found]


def _plot(rows, base, out: Path, tokens: int | None) -> list[str]:
    """One figure per x axis (:data:`PLOTS`), a facet per family (:func:`family`), the DDP
    and DiLoCo rows repeated in grey in the facets they are not in; the eval-loss axis is
    shared."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    R, H = base.mesh.replica, base.train.sync_every
    title = f"{base.name}: R={R}, H={H}, " + (
        f"{tokens:,} tokens per run" if tokens else "tokens per run n/a"
    )
    styles = dict(zip((id(r) for r in rows), plot_styles(len(rows)), strict=True))
    limits = y_limits(rows)
    entropy = _entropy(rows)
    floor_label = "entropy floor"
    if entropy is not None and limits is not None and not limits[0] <= entropy <= limits[1]:
        floor_label = f"entropy floor {entropy:.3f} (off the axis)"
    order = [name for name, _ in FAMILIES]
    facets: dict[str, list[dict]] = {}
    for r in sorted(rows, key=lambda r: [*order, family(r)].index(family(r))):
        facets.setdefault(family(r), []).append(r)
    references = _references(rows)
    cols = 2 if len(facets) > 1 else 1
    grid = (math.ceil(len(facets) / cols), cols)
    names = []
    for key, xlabel, name, log in PLOTS:
        fig, axes = plt.subplots(
            *grid, figsize=(7.2 * cols, 3.6 * grid[0]), sharey=True, squeeze=False
        )
        drawn = 0

        def curve(ax, r, key=key, log=log, **style):
            xs = np.asarray(r[key], dtype=float)
            ys = np.asarray(r["curve_loss"], dtype=float)
            keep = np.isfinite(xs) & np.isfinite(ys)
            xs, ys = xs[keep], ys[keep]
            if log:
                xs = np.maximum(xs, 1.0)
            ax.plot(xs, ys, ms=3, **style)

        for ax, (facet, members) in zip(axes.flat, facets.items(), strict=False):
            for ref, (grey, ls) in zip(references, (("0.35", "--"), ("0.65", "-.")), strict=False):
                if all(ref is not m for m in members):
                    label = ref["label"] + " (reference)"
                    curve(ax, ref, color=grey, ls=ls, lw=1.0, label=label)
            for r in members:
                if r.get("status") != "done":
                    continue
                colour, ls, marker = styles[id(r)]
                label = r["label"] + (f" ({r['flag']})" if r.get("flag") else "")
                curve(ax, r, color=colour, ls=ls, marker=marker, lw=1.4, label=label)
                drawn += 1
            if entropy is not None:
                ax.axhline(entropy, color="k", ls=":", lw=1, label=floor_label)
            ax.set_title(facet, fontsize=9)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("eval loss (nats/token)")
            if log:
                ax.set_xscale("log")
            if limits is not None:
                ax.set_ylim(*limits)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7, loc="upper right")
        for ax in axes.flat[len(facets) :]:
            ax.set_visible(False)
        if not drawn:
            axes.flat[0].text(
                0.5, 0.5, "no finished rows yet", ha="center", transform=axes.flat[0].transAxes
            )
        fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        save_figure(fig, out / name, dpi=110, bbox_inches="tight")
        plt.close(fig)
        names.append(name)
    return names


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _doc(algorithm: str, out: Path) -> str:
    """The algorithm's page in this repository (a relative link when the report is in it)."""
    page = REPO / "docs" / "algorithms" / f"{algorithm}.md"
    if not page.exists():
        return ""
    shown = f"docs/algorithms/{algorithm}.md"
    try:
        out.resolve().relative_to(REPO)
    except ValueError:
        return f"`{shown}`"
    return f"[{shown}]({os.path.relpath(page, out.resolve())})"


def write_report(
    rows: list[dict],
    base: config_lib.Config,
    out: Path,
    link: Link,
    interrupted: bool = False,
) -> Path:
    """Writes ``out/report.md``, ``out/summary.json`` and the plots from the rows so far (each
    file replaced whole): finished rows with their numbers, failed rows with their error,
    the rest "not run"."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    done = [r for r in rows if r.get("status") == "done"]
    failed = [r for r in rows if r.get("status") == "failed"]
    ddp = next((r for r in done if r["algorithm"] == "ddp"), None)
    first = done[0] if done else None
    tokens = first["tokens"] if first else None
    entropy = first["entropy"] if first else None
    plots = _plot(rows, base, out, tokens)

    seeds = len(first.get("seed_losses", [None])) if first else 1
    reused = sum(1 for r in done if not r.get("ran"))
    status = (
        f"{len(done)} of {len(rows)} rows done ({reused} reused from earlier runs), "
        f"{len(failed)} failed, {len(rows) - len(done) - len(failed)} not run."
    )
    if interrupted:
        status += " Interrupted (Ctrl-C): the rows marked not run did not run; rerun to finish."
    device = device_label()
    short = "CPU-emulated" if "CPU-emulated" in device else device
    lines = [
        f"# co2jax comparison: {base.name}",
        "",
        f"{base.mesh.replica} replicas x {base.mesh.data} data shards, H={base.train.sync_every},"
        f" {base.train.rounds} rounds, "
        + (f"{tokens:,} training tokens per run; " if tokens else "")
        + f"data `{base.data.kind}`"
        + (f" (entropy floor {entropy:.4f} nats/token)" if entropy else "")
        + ".",
        f"Modelled link: {link.bandwidth_gbps} Gbit/s, {link.latency_ms} ms latency, overlap "
        f"slows compute by {link.overlap_slowdown:.1%}."
        + (
            f" Eval loss: mean ± standard deviation over {seeds} seeds (the other columns:"
            " the first seed)."
            if seeds > 1
            else " One seed per algorithm (`--seeds N` for the seed-to-seed spread)."
        ),
        status,
        "",
        f"Measured on {device}: tokens/s and the compute part of the modelled wall clock "
        "(each round's measured compute time, plus the modelled link's time for the bytes "
        "the round sends where it does not overlap). On emulated devices compute time says "
        "how the host ran the program, not what an accelerator would: compare the rows' "
        "bytes and losses, not their times. A diverged or non-finite row shows no ratio or "
        "time.",
        "",
        "| algorithm | eval loss | excess over entropy | MB sent / replica | vs DDP | tokens/s "
        f"(measured, {short}) | modelled wall clock (s; compute measured, {short}) | status |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("status") != "done":
            note = f"failed: {r['error']}" if r.get("status") == "failed" else "not run"
            lines.append(f"| {_cell(r['label'])} | | | | | | | {_cell(note)} |")
            continue
        excess = "n/a" if r["excess"] is None else f"{r['excess']:.4f}"
        ratio = format_ratio(
            r["bytes_total"] / ddp["bytes_total"] if ddp and ddp["bytes_total"] else None
        )
        loss = f"{r['eval_loss']:.4f}"
        if r.get("eval_std") is not None:
            loss += f" ± {r['eval_std']:.4f}"
        note = "reused" if not r.get("ran") else "done"
        speed, wall = f"{r['tokens_per_s']:,.0f}", f"{r['sim_s']:.1f}"
        if r.get("flag"):  # not priced: a diverged run's bytes and time compare nothing
            note += f", {r['flag']} (not used for the plots' y range)"
            ratio, speed, wall = "—", "—", "—"
        lines.append(
            f"| {_cell(r['label'])} | {loss} | {excess} | {r['bytes_total'] / 1e6:.2f} "
            f"| {ratio} | {speed} | {wall} | {note} |"
        )
    lines += [
        "",
        "## Rows",
        "",
        "Each row's overrides of the sweep's base config and its outer hyper-parameters that "
        "differ from its settings' defaults (`co2jax.algorithms.registry`); the linked "
        "`config.json` is the "
        "whole resolved config, `hash` its content hash (a finished run with the same hash is "
        "reused).",
        "",
    ]
    for r in rows:
        hyper = ", ".join(f"{k}={v}" for k, v in r.get("hyper", {}).items())
        overrides = " ".join(f"`{o}`" for o in r.get("overrides", [])) or "none"
        doc = _doc(r.get("algorithm", ""), out)
        lines.append(
            f"- **{r['label']}**: overrides {overrides}; outer {hyper or 'defaults'}; "
            f"[config]({r['config']}) (hash `{r['hash']}`)" + (f"; {doc}" if doc else "")
        )
    lines += [
        "",
        "## Published claims against this sweep",
        "",
        f'Each claim checked on the rows\' eval losses; "matches" means within {MATCH:.0%} '
        "(relative). A miniature run on emulated devices tests the direction of a claim, "
        "not its size.",
        "",
        *verdicts(rows),
        "",
        PUBLISHED,
        "",
        *[f"![{p}]({p})" for p in plots],
        "",
    ]
    path = out / "report.md"
    write_atomic(out / "summary.json", json.dumps(rows, indent=1))
    write_atomic(path, "\n".join(lines))
    return path
