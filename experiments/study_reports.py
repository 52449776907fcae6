"""The fidelity studies' tables, plots and targets (:mod:`experiments.studies` holds the rows).

Each ``*_report`` function takes the study's rows and the per-seed results and returns the
report's sections (markdown), its targets and the numbers behind them; the plots go to
``out``. A cell with no finished run reads "not run", and a target whose runs are missing is
"not measured", so a partial or failed sweep still reports what it has.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np

from experiments.bytes_report import bytes_report as bytes_report  # the bytes study's
from experiments.files import save_figure
from experiments.orderings_report import orderings_report as orderings_report
from experiments.studies import (
    EAGER_REPLICAS,
    EAGER_SIZE,
    VARIANTS,
    Target,
    best_inner_lr,
    final_losses,
    fmt,
    mean_sd,
)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _mean(records) -> float:
    return mean_sd(final_losses(records))[0]


def _ok(values) -> bool:
    return all(v is not None and math.isfinite(v) for v in values)


def _pct(x: float) -> str:
    return "not run" if not math.isfinite(x) else f"{100 * x:+.2f}%"


# ---------------------------------------------------------------------------------------------
# scaling


def scaling_report(rows, results, out: Path):
    sizes = list(dict.fromkeys(r.meta["size"] for r in rows))
    cells = [r for r in rows if r.meta["kind"] == "diloco"]
    Ms = sorted({r.meta["M"] for r in cells})
    H_top = max(r.meta["H"] for r in cells)
    lrs = sorted({r.meta["lr"] for r in cells if r.meta["H"] == H_top})
    Hs = sorted({r.meta["H"] for r in cells})
    inner = {s: best_inner_lr(rows, results, s) for s in sizes}
    inner_lrs = sorted({r.meta["inner_lr"] for r in rows if r.meta["kind"] == "dp"})
    by, dp_grid = {}, {}
    for r in rows:
        m = r.meta
        if m["kind"] == "dp":
            dp_grid[m["size"], m["inner_lr"]] = results.get(r.label, [])
            if m["inner_lr"] == inner[m["size"]]:
                by["dp", m["size"]] = results.get(r.label, [])
        else:
            by[m["size"], m["M"], m["H"], m["lr"]] = results.get(r.label, [])
    dp = {s: _mean(by.get(("dp", s), [])) for s in sizes}
    best, rel = {}, {}  # best outer lr and its loss relative to DP, per (size, M) at H_top
    for s in sizes:
        for M in Ms:
            grid = {lr: _mean(by.get((s, M, H_top, lr), [])) for lr in lrs}
            grid = {lr: v for lr, v in grid.items() if math.isfinite(v)}
            if grid:
                lr = min(grid, key=grid.get)
                best[s, M] = (lr, grid[lr])
                rel[s, M] = grid[lr] / dp[s] - 1 if math.isfinite(dp[s]) else math.nan

    steps = {r.meta["size"]: r.meta["steps"] for r in rows}
    sections = ["## DP's inner learning rate (DiLoCo runs at each size's best)", ""]
    sections += ["| size | " + " | ".join(f"lr {lr:g}" for lr in inner_lrs) + " | best |"]
    sections += ["|---" * (2 + len(inner_lrs)) + "|"]
    for s in sizes:
        vals = [fmt(final_losses(dp_grid.get((s, lr), []))) for lr in inner_lrs]
        edge = " (grid edge)" if inner[s] in (inner_lrs[0], inner_lrs[-1]) else ""
        sections.append(f"| {s} | " + " | ".join(vals) + f" | {inner[s]}{edge} |")
    sections += ["", f"## Eval loss relative to DP (best outer lr per M, H = {H_top})", ""]
    sections += ["| size | steps | DP | " + " | ".join(f"M = {M}" for M in Ms) + " |"]
    sections += ["|---" * (3 + len(Ms)) + "|"]
    for s in sizes:
        row = [s, str(steps[s]), fmt(final_losses(by.get(("dp", s), [])))]
        for M in Ms:
            if (s, M) in best:
                lr = best[s, M][0]
                losses = final_losses(by[(s, M, H_top, lr)])
                row.append(f"{fmt(losses)} ({_pct(rel[s, M])})")
            else:
                row.append("not run")
        sections.append("| " + " | ".join(row) + " |")
    sections += ["", f"## Eval loss by outer learning rate (H = {H_top})", ""]
    sections += ["| size | M | " + " | ".join(f"lr {lr}" for lr in lrs) + " | best |"]
    sections += ["|---" * (3 + len(lrs)) + "|"]
    for s in sizes:
        for M in Ms:
            vals = [fmt(final_losses(by.get((s, M, H_top, lr), []))) for lr in lrs]
            b = best.get((s, M), (None,))[0]
            sections.append(f"| {s} | {M} | " + " | ".join(vals) + f" | {b} |")
    sections += ["", f"## Eval loss by H (each M at its best outer lr at H = {H_top})", ""]
    sections += ["| size | M | " + " | ".join(f"H = {H}" for H in Hs) + " |"]
    sections += ["|---" * (2 + len(Hs)) + "|"]
    for s in sizes:
        for M in Ms:
            lr = best.get((s, M), (None,))[0]
            vals = [fmt(final_losses(by.get((s, M, H, lr), []))) for H in Hs]
            sections.append(f"| {s} | {M} | " + " | ".join(vals) + " |")
    sections += [
        "",
        "Plots: `scaling_relative.png` (loss relative to DP against M, per size), "
        "`scaling_best_lr.png` (the best outer lr against M), `scaling_h.png` (loss against H).",
    ]
    _scaling_plots(out, sizes, Ms, Hs, lrs, by, dp, best, rel, H_top)

    targets = []
    # M = 1 <= DP, at every size
    pairs = [(s, rel.get((s, 1), math.nan)) for s in sizes if 1 in Ms]
    measured = [p for p in pairs if math.isfinite(p[1])]
    targets.append(
        Target(
            "DiLoCo with M = 1 is no worse than DP",
            None if not measured or len(measured) < len(pairs) else all(x <= 0 for _, x in pairs),
            "; ".join(f"{s}: {_pct(x)}" for s, x in pairs) or "no M = 1 runs",
        )
    )
    # loss rises with M, at every size
    rises, text = [], []
    for s in sizes:
        seq = [best[s, M][1] if (s, M) in best else math.nan for M in Ms]
        if _ok(seq) and len(seq) > 1:
            rises.append(all(a < b for a, b in itertools.pairwise(seq)))
            text.append(f"{s}: " + " < ".join(f"{v:.4f}" for v in seq))
    targets.append(
        Target(
            "the loss rises with M (best outer lr per M)",
            all(rises) if rises and len(rises) == len(sizes) else None,
            "; ".join(text) or "fewer than two M measured",
        )
    )
    # the gap to DP shrinks with size, for every M >= 2
    shrinks, text = [], []
    for M in [M for M in Ms if M >= 2]:
        seq = [rel.get((s, M), math.nan) for s in sizes]
        if _ok(seq) and len(seq) > 1:
            shrinks.append(all(a > b for a, b in itertools.pairwise(seq)))
            text.append(f"M = {M}: " + " > ".join(_pct(v) for v in seq))
    targets.append(
        Target(
            "the gap to DP shrinks with model size (every M >= 2, sizes in order)",
            all(shrinks) if shrinks else None,
            "; ".join(text) or "fewer than two sizes measured",
        )
    )
    # the best outer lr rises with M (non-decreasing, and higher at the largest M than at 1)
    grows, text = [], []
    for s in sizes:
        seq = [best[s, M][0] if (s, M) in best else None for M in Ms]
        if all(v is not None for v in seq) and len(seq) > 1 and len(lrs) > 1:
            grows.append(all(a <= b for a, b in itertools.pairwise(seq)) and seq[-1] > seq[0])
            text.append(f"{s}: " + ", ".join(str(v) for v in seq))
    targets.append(
        Target(
            "the best outer lr rises with M",
            all(grows) if grows and len(grows) == len(sizes) else None,
            "; ".join(text) or "a single outer lr measured",
        )
    )
    # H = 1 worst, at every size and M
    worst, text, misses = [], [], []
    for s in sizes:
        for M in Ms:
            lr = best.get((s, M), (None,))[0]
            seq = {H: _mean(by.get((s, M, H, lr), [])) for H in Hs}
            if 1 in seq and _ok(seq.values()) and len(seq) > 1:
                ok = all(seq[1] > v for H, v in seq.items() if H != 1)
                worst.append(ok)
                if not ok:
                    misses.append(f"{s} M = {M}")
    text.append(f"{sum(worst)} of {len(worst)} (size, M) pairs")
    if misses:
        text.append("not at " + ", ".join(misses))
    targets.append(
        Target(
            f"H = 1 is the worst H (each M at its best outer lr at H = {H_top})",
            all(worst) if worst else None,
            "; ".join(text),
        )
    )
    data = {
        "inner_lr": inner,
        "dp": dp,
        "best": {f"{s} M={M}": v for (s, M), v in best.items()},
        "relative": {f"{s} M={M}": v for (s, M), v in rel.items()},
    }
    return sections, targets, data


def _scaling_plots(out, sizes, Ms, Hs, lrs, by, dp, best, rel, H_top) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for s in sizes:
        xs = [M for M in Ms if (s, M) in rel and math.isfinite(rel[s, M])]
        ax.plot(xs, [100 * rel[s, M] for M in xs], marker="o", label=s)
    ax.axhline(0, color="k", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xticks(Ms, [str(M) for M in Ms])
    ax.set_xlabel("replicas M")
    ax.set_ylabel("eval loss relative to DP (%)")
    ax.set_title(f"DiLoCo vs DP, best outer lr per M, H = {H_top}", fontsize=9)
    ax.legend(title="parameters", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, out / "scaling_relative.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.5, 4))
    for i, s in enumerate(sizes):
        xs = [M for M in Ms if (s, M) in best]
        ax.plot(xs, [best[s, M][0] + 0.01 * (i - 1) for M in xs], marker="o", label=s)
    ax.set_xscale("log", base=2)
    ax.set_xticks(Ms, [str(M) for M in Ms])
    ax.set_yticks(lrs)
    ax.set_xlabel("replicas M")
    ax.set_ylabel("best outer learning rate (grid)")
    ax.set_title("best outer lr per M (points offset per size to stay visible)", fontsize=9)
    ax.legend(title="parameters", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, out / "scaling_best_lr.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(sizes), figsize=(4.5 * len(sizes), 3.8), squeeze=False)
    for ax, s in zip(axes[0], sizes, strict=True):
        for M in Ms:
            lr = best.get((s, M), (None,))[0]
            vals = [final_losses(by.get((s, M, H, lr), [])) for H in Hs]
            xs = [H for H, v in zip(Hs, vals, strict=True) if v]
            ms = [np.mean(v) for v in vals if v]
            err = [np.std(v, ddof=1) if len(v) > 1 else 0.0 for v in vals if v]
            ax.errorbar(xs, ms, yerr=err, marker="o", capsize=3, label=f"M = {M}")
        if math.isfinite(dp[s]):
            ax.axhline(dp[s], color="k", lw=0.8, ls="--", label="DP")
        ax.set_xscale("log")
        ax.set_xlabel("H (inner steps per round)")
        ax.set_title(f"{s} parameters, best outer lr at H = {H_top} per M", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("final eval loss")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, out / "scaling_h.png", dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# eager updates


def eager_report(rows, results, out: Path):
    by_m = [r for r in rows if r.meta["M"] != EAGER_REPLICAS]
    rows = [r for r in rows if r.meta["M"] == EAGER_REPLICAS]
    Hs = sorted({r.meta["H"] for r in rows})
    keys = [k for k, _, _ in VARIANTS]
    names = {k: label for k, label, _ in VARIANTS}
    loss = {(r.meta["H"], r.meta["variant"]): final_losses(results.get(r.label, [])) for r in rows}
    mean = {k: mean_sd(v)[0] for k, v in loss.items()}
    penalty = {(H, k): mean[H, k] - mean[H, "none"] for H in Hs for k in keys if k != "none"}
    size = {r.meta.get("size", EAGER_SIZE) for r in rows} or {EAGER_SIZE}
    model = ", ".join(sorted(size)) + " parameters" if "smoke" not in size else "the smoke model"
    sections = [f"## Final eval loss (M = {EAGER_REPLICAS}, {model})", ""]
    sections += ["| H | " + " | ".join(names[k] for k in keys) + " |"]
    sections += ["|---" * (1 + len(keys)) + "|"]
    for H in Hs:
        sections.append(f"| {H} | " + " | ".join(fmt(loss[H, k]) for k in keys) + " |")
    sections += ["", "## Penalty: loss minus the no-overlap loss at the same H", ""]
    sections += ["| H | " + " | ".join(names[k] for k in keys if k != "none") + " |"]
    sections += ["|---" * len(keys) + "|"]
    for H in Hs:
        cells = [f"{penalty[H, k]:+.4f}" for k in keys if k != "none"]
        sections.append(f"| {H} | " + " | ".join(cells) + " |")
    sections += ["", "Plot: `eager_penalty.png` (each variant's penalty against H)."]
    m_sections, m_data = _eager_by_m(by_m, results, mean)
    sections += m_sections

    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for k in keys:
        if k == "none":
            continue
        xs = [H for H in Hs if math.isfinite(penalty[H, k])]
        ax.plot(xs, [penalty[H, k] for H in xs], marker="o", label=names[k])
    ax.axhline(0, color="k", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_xlabel("H (inner steps per round)")
    ax.set_ylabel("eval loss minus no overlap")
    ax.set_title(f"overlap penalty against H (M = {EAGER_REPLICAS})", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, out / "eager_penalty.png", dpi=110)
    plt.close(fig)

    naive = [penalty[H, "naive"] for H in Hs]
    grows = _ok(naive) and len(naive) > 1
    targets = [
        Target(
            "the naive-delay penalty grows with H",
            all(a < b for a, b in itertools.pairwise(naive)) if grows else None,
            ", ".join(f"H = {H}: {p:+.4f}" for H, p in zip(Hs, naive, strict=True)),
        )
    ]
    H30 = 30 if 30 in Hs else None
    if H30 is None:
        targets.append(
            Target("the naive-delay penalty is >= 5x eager's at H = 30", None, "no H = 30")
        )
    else:
        n, e = penalty[H30, "naive"], penalty[H30, "eager"]
        held = None if not _ok([n, e]) else bool(n > 0 and n >= 5 * e)
        ratio = f"{n / e:.1f}x" if _ok([n, e]) and e > 0 else "eager's penalty is <= 0"
        targets.append(
            Target(
                "the naive-delay penalty is >= 5x eager's at H = 30",
                held,
                f"naive {n:+.4f}, eager {e:+.4f} ({ratio})",
            )
        )
    data = {f"H={H} {k}": v for (H, k), v in mean.items()} | m_data
    return sections, targets, data


def _eager_by_m(rows, results, mean_at_top):
    """The naive and eager penalties at one H for each M: eager's fresh term is 1/M of the
    update, so the share of the naive delay's cost it recovers is expected to fall with M."""
    if not rows:
        return [], {}
    H = rows[0].meta["H"]
    mean = {
        (r.meta["M"], r.meta["variant"]): mean_sd(final_losses(results.get(r.label, [])))[0]
        for r in rows
    }
    for k in ("none", "naive", "eager"):
        mean[EAGER_REPLICAS, k] = mean_at_top.get((H, k), math.nan)
    ms = sorted({m for m, _ in mean})
    sections = ["", f"## Penalty at H = {H} by replicas", ""]
    sections += [
        "| M | no overlap | naive delayed | eager | naive / eager |",
        "|---|---|---|---|---|",
    ]
    data = {}
    for m in ms:
        n = mean[m, "naive"] - mean[m, "none"]
        e = mean[m, "eager"] - mean[m, "none"]
        ratio = f"{n / e:.1f}x" if _ok([n, e]) and e > 0 else "-"
        sections.append(f"| {m} | {mean[m, 'none']:.4f} | {n:+.4f} | {e:+.4f} | {ratio} |")
        data[f"H={H} M={m} naive penalty"], data[f"H={H} M={m} eager penalty"] = n, e
    sections += [
        "",
        "Eager's own term is each replica's fresh pseudo-gradient over M; with more "
        "replicas the update is mostly the stale average, as in the naive delay.",
    ]
    return sections, data
