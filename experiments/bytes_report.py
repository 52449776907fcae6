"""The bytes study's report: loss against bytes sent, at a common budget and at equal
quality (:mod:`experiments.studies` holds the rows, :mod:`experiments.study_reports` the
other studies' reports)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from experiments.files import save_figure
from experiments.studies import final_losses, fmt


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


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
    save_figure(fig, out / "loss_vs_bytes.png", dpi=110)
    plt.close(fig)
    data = {"budget": budget, "final_bytes": finals, "first_eval_bytes": firsts}
    return sections, [], data
