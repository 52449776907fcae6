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
    fig.savefig(out / "scaling_relative.png", dpi=110)
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
    fig.savefig(out / "scaling_best_lr.png", dpi=110)
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
    fig.savefig(out / "scaling_h.png", dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# eager updates


def eager_report(rows, results, out: Path):
    Hs = sorted({r.meta["H"] for r in rows})
    keys = [k for k, _, _ in VARIANTS]
    names = {k: label for k, label, _ in VARIANTS}
    loss = {(r.meta["H"], r.meta["variant"]): final_losses(results.get(r.label, [])) for r in rows}
    mean = {k: mean_sd(v)[0] for k, v in loss.items()}
    penalty = {(H, k): mean[H, k] - mean[H, "none"] for H in Hs for k in keys if k != "none"}
    sections = [f"## Final eval loss (M = {EAGER_REPLICAS}, {EAGER_SIZE} parameters)", ""]
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
    fig.savefig(out / "eager_penalty.png", dpi=110)
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
    data = {f"H={H} {k}": v for (H, k), v in mean.items()}
    return sections, targets, data


# ---------------------------------------------------------------------------------------------
# compression at equal bytes


def _curve(record) -> tuple[np.ndarray, np.ndarray]:
    points = [(r["bytes_total"], r["eval_loss"]) for r in record["history"] if "eval_loss" in r]
    return np.array([p[0] for p in points], float), np.array([p[1] for p in points], float)


def _at_bytes(record, budget: float) -> float:
    """The eval loss at ``budget`` bytes, interpolated in log bytes (NaN outside the curve)."""
    x, y = _curve(record)
    ok = x > 0
    if not ok.any() or budget < x[ok][0] or budget > x[ok][-1]:
        return math.nan
    return float(np.interp(np.log(budget), np.log(x[ok]), y[ok]))


def _bytes_to_reach(records, loss: float) -> float:
    """Bytes per replica at the first evaluation where the seeds' mean loss is <= ``loss``."""
    if not records or not math.isfinite(loss):
        return math.nan
    curves = [_curve(r) for r in records]
    length = min(len(c[0]) for c in curves)
    x = np.mean([c[0][:length] for c in curves], axis=0)
    y = np.mean([c[1][:length] for c in curves], axis=0)
    hits = np.nonzero(y <= loss)[0]
    return float(x[hits[0]]) if len(hits) else math.nan


def _diverged(records) -> bool:
    """A seed whose eval loss is non-finite or ended above where it started."""
    for r in records:
        y = _curve(r)[1]
        if not np.all(np.isfinite(y)) or (len(y) > 1 and y[-1] > y[0]):
            return True
    return False


def bytes_report(rows, results, out: Path):
    names = [r.meta["name"] for r in rows]
    recs = {r.meta["name"]: results.get(r.label, []) for r in rows}
    finals = {n: [float(r["history"][-1]["bytes_total"]) for r in recs[n]] for n in names}
    done = [n for n in names if recs[n]]
    # the common budget: the least any row sent in all, where every row's curve reaches it
    budget = min((min(finals[n]) for n in done), default=math.nan)
    firsts = [_curve(r)[0][0] for n in done for r in recs[n] if len(_curve(r)[0])]
    at = {n: [_at_bytes(r, budget) for r in recs[n]] for n in done}
    sections = ["## Final eval loss and bytes per replica (same tokens)", ""]
    ref = np.mean(finals.get("DiLoCo") or [math.nan])
    # equal quality: the bytes at which a row's mean curve first reaches DiLoCo's final loss
    # (float32, the uncompressed reference) within 0.5%
    quality = 1.005 * float(np.mean(final_losses(recs.get("DiLoCo", [])) or [math.nan]))
    sections += [
        "| row | final eval loss | bytes per replica | ratio to DiLoCo | "
        f"loss at {budget:.3g} bytes | bytes to reach {quality:.4f} |",
        "|---|---|---|---|---|---|",
    ]
    flags = {n: _diverged(recs[n]) for n in done}
    ref_reach = _bytes_to_reach(recs.get("DiLoCo", []), quality)
    for n in names:
        if not recs[n]:
            sections.append(f"| {n} | not run | | | | |")
            continue
        if flags[n]:
            sections.append(f"| {n} | diverged ({fmt(final_losses(recs[n]))}) | | | | |")
            continue
        b = float(np.mean(finals[n]))
        vals = [v for v in at[n] if math.isfinite(v)]
        at_text = fmt(vals) if vals else "below the first evaluation"
        ratio = f"1/{ref / b:.1f}" if math.isfinite(ref) and b > 0 else "n/a"
        reach = _bytes_to_reach(recs[n], quality)
        reach_text = "not reached" if not math.isfinite(reach) else f"{reach:.3g}"
        if math.isfinite(reach) and math.isfinite(ref_reach):
            reach_text += f" (1/{ref_reach / reach:.1f})"
        sections.append(
            f"| {n} | {fmt(final_losses(recs[n]))} | {b:.3g} | {ratio} | {at_text} | {reach_text} |"
        )
    sections += [
        "",
        "The common budget is the smallest total any row sent; a row's loss there is its "
        "eval curve interpolated in log bytes (rows that send more reach the budget in their "
        "first rounds, before their first evaluation: 'below the first evaluation'). Equal "
        "quality: the bytes each row had sent at its first evaluation whose mean over seeds "
        "was within 0.5% of DiLoCo's final loss, and the ratio to DiLoCo's.",
        "",
        "Plot: `loss_vs_bytes.png`: the mean over seeds, with the band from the lowest to "
        "the highest seed.",
    ]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    kept = [y for n in done if not flags[n] for r in recs[n] for y in _curve(r)[1]]
    for n in done:
        curves = [_curve(r) for r in recs[n]]
        length = min(len(c[0]) for c in curves)
        x = np.mean([c[0][:length] for c in curves], axis=0)
        ys = np.array([c[1][:length] for c in curves])
        line = ax.plot(x, ys.mean(axis=0), label=n + (" (diverged)" if flags[n] else ""))[0]
        if len(curves) > 1:
            ax.fill_between(x, ys.min(axis=0), ys.max(axis=0), alpha=0.2, color=line.get_color())
    if math.isfinite(budget):
        ax.axvline(budget, color="k", lw=0.8, ls=":")
    if kept:  # the rows that trained set the y range; a diverged one runs off the top
        low, high = min(kept), max(kept)
        ax.set_ylim(low - 0.05 * (high - low), high + 0.05 * (high - low))
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent per replica")
    ax.set_ylabel("eval loss")
    ax.set_title("compressed pseudo-gradients at equal tokens, by bytes sent", fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss_vs_bytes.png", dpi=110)
    plt.close(fig)
    data = {"budget": budget, "final_bytes": finals, "first_eval_bytes": firsts}
    return sections, [], data
