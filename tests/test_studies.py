"""The fidelity studies (experiments/studies.py): each sweep end to end at its smallest grid,
the targets' verdicts on made-up results, and the Table 6 cost model against a step-by-step
simulation of the same schedule."""

import json
import math
import os
from concurrent.futures.process import BrokenProcessPool

import numpy as np
import pytest

from benchmarks import utilization
from experiments import bytes_report, compare, orderings_report, studies, study_reports, study_run
from experiments import config as config_lib


def _fake(rows, loss_of):
    """Results as the runs would leave them: three seeds per row, final losses loss_of(meta)
    plus a small seed spread, and a bytes/eval history for the curves."""
    results = {}
    for r in rows:
        base = loss_of(r.meta)
        results[r.label] = [
            {
                "history": [
                    {"bytes_total": 1e3 * (k + 1), "eval_loss": base + 0.1 * (2 - k) + d}
                    for k in range(3)
                ]
            }
            for d in (-1e-4, 0.0, 1e-4)
        ]
    return results


def _verdicts(targets):
    return {t.claim.split(" (")[0]: t.held for t in targets}


def _scaling(loss_of, tmp_path):
    rows = studies.scaling_rows()  # DP; then DiLoCo at its best inner lr; then the H rows
    phases = 1
    while True:
        results = _fake(rows, loss_of)
        more = studies.scaling_rows(results=results)
        if {r.label for r in more} == {r.label for r in rows}:
            break
        rows, phases = more, phases + 1
    assert phases == 3 and len(rows) == 3 * (5 + 4 * 3 + 4 * 2)
    return study_reports.scaling_report(rows, results, tmp_path)


SIZE = {"37k": 0, "80k": 1, "140k": 2}


def _published(meta):
    """A made-up study that has every published property."""
    if meta["kind"] == "dp":
        return 2.0 - 0.1 * SIZE[meta["size"]] + abs(math.log(meta["inner_lr"] / 6e-3))
    M, H, lr = meta["M"], meta["H"], meta["lr"]
    best_lr = {1: 0.2, 2: 0.45, 4: 0.45, 8: 1.0}[M]
    gap = 0.01 * math.log2(M) / (1 + SIZE[meta["size"]]) - 0.002
    h_pen = {1: 0.2, 10: 0.01, 30: 0.0}[H]
    return (2.0 - 0.1 * SIZE[meta["size"]]) * (1 + gap) + h_pen + 0.05 * abs(lr - best_lr)


def test_scaling_targets_hold_on_a_study_with_the_published_properties(tmp_path):
    sections, targets, data = _scaling(_published, tmp_path)
    assert all(t.held is True for t in targets), [t.line() for t in targets]
    assert data["inner_lr"] == {"37k": 6e-3, "80k": 6e-3, "140k": 6e-3}
    assert data["best"]["80k M=8"][0] == 1.0
    for name in ("scaling_relative.png", "scaling_best_lr.png", "scaling_h.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert any("| 37k | 8 |" in line for line in sections)


@pytest.mark.parametrize(
    "claim, broken",
    [
        (
            "DiLoCo with M = 1 is no worse than DP",
            lambda m, v: v + 0.01 * (m.get("M") == 1 and m["size"] == "37k"),
        ),
        ("the loss rises with M", lambda m, v: v - 0.05 * (m.get("M") == 8)),
        (
            "the gap to DP shrinks with model size",
            lambda m, v: v + 0.004 * (m.get("size") == "140k" and m.get("M") == 2),
        ),
        (
            "the best outer lr rises with M",
            lambda m, v: v - 0.045 * (m.get("M") == 8 and m.get("lr") == 0.2),
        ),
        ("H = 1 is the worst H", lambda m, v: v - 0.5 * (m.get("H") == 1 and m["M"] == 2)),
    ],
)
@pytest.mark.cases("first", 2)
def test_each_scaling_target_fails_when_its_property_is_broken(claim, broken, tmp_path):
    _, targets, _ = _scaling(lambda m: broken(m, _published(m)), tmp_path)
    verdicts = _verdicts(targets)
    assert verdicts[claim] is False
    assert sum(v is False for v in verdicts.values()) == 1, verdicts


def test_eager_targets(tmp_path):
    rows = studies.eager_rows()

    def loss(meta, naive_growth=True, eager=0.003):
        grow = {10: 1.0, 30: 2.0, 100: 3.0}[meta["H"]] if naive_growth else 1.0
        pen = {"none": 0.0, "naive": 0.02 * grow, "eager": eager, "inner1": 0.01}
        return 2.0 + pen[meta["variant"]]

    _, targets, data = study_reports.eager_report(rows, _fake(rows, loss), tmp_path)
    assert [t.held for t in targets] == [True, True]  # rising, and 0.04 >= 5 x 0.003
    assert data["H=30 naive"] == pytest.approx(2.04)

    # the targets read M = 8 only; the table by M reads each M's own rows
    def by_m(meta):
        return loss(meta) + (0.01 * meta["M"] if meta["variant"] == "eager" else 0.0)

    sections, targets, data = study_reports.eager_report(rows, _fake(rows, by_m), tmp_path)
    assert [t.held for t in targets] == [True, False]  # eager at M = 8: 0.083 > 0.04 / 5
    for m in (2, 4, 8):
        assert data[f"H=30 M={m} eager penalty"] == pytest.approx(0.003 + 0.01 * m)
        assert data[f"H=30 M={m} naive penalty"] == pytest.approx(0.04)
    assert "| 2 | 2.0000 | +0.0400 | +0.0230 | 1.7x |" in sections
    assert "## Final eval loss (M = 8, 140k parameters)" in sections
    smoke = studies.eager_rows(smoke=True)
    sections, _, _ = study_reports.eager_report(smoke, _fake(smoke, lambda m: 2.0), tmp_path)
    assert "## Final eval loss (M = 8, the smoke model)" in sections
    flat = _fake(rows, lambda m: loss(m, naive_growth=False, eager=0.006))
    _, targets, _ = study_reports.eager_report(rows, flat, tmp_path)
    assert [t.held for t in targets] == [False, False]  # flat, and 0.02 < 5 x 0.006
    assert (tmp_path / "eager_penalty.png").stat().st_size > 0


def test_bytes_report_interpolates_in_log_bytes(tmp_path):
    record = {
        "history": [
            {"bytes_total": 10.0, "eval_loss": 3.0},
            {"bytes_total": 1000.0, "eval_loss": 1.0},
        ]
    }
    assert bytes_report._at_bytes(record, 100.0) == pytest.approx(2.0)
    assert math.isnan(bytes_report._at_bytes(record, 5.0))
    rows = studies.bytes_rows()
    _sections, targets, data = bytes_report.bytes_report(rows, _fake(rows, lambda m: 2.0), tmp_path)
    assert targets == [] and data["budget"] == pytest.approx(3e3)
    assert (tmp_path / "loss_vs_bytes.png").stat().st_size > 0


ORDERED = {  # made-up final losses in which every published ordering holds
    "DiLoCo H=30": 2.0,
    "DiLoCo H=60": 2.05,
    "SPARTA p=1/30": 2.1,
    "SPARTA-DiLoCo H=60 p=1/60": 1.99,
    "Local SGD H=30 (local Adam states)": 2.1,
    "Local Adam H=60": 2.03,
    "DES-LOC H=30 (3, 6)": 2.02,
    "MuLoCo H=30 (Muon lr x16)": 1.95,
    "MuLoCo H=30 (Muon lr x1)": 2.2,
    "MuLoCo H=30 (Muon lr x16, AdamW x1)": 1.96,
    "MuLoCo H=30 uncompressed": 1.94,
    "DiLoCo H=10": 1.97,
    "Hierarchical H1=10 K=3": 1.98,
    "Hierarchical H1=10 K=3 (region mean, global Nesterov)": 1.985,
    "DiLoCo H=30 momentum restarts (every 5)": 2.0,
    "DiLoCo H=30 momentum warm-up and decay (10, 10)": 1.99,
    "DDP AdamW": 1.9,
    "DDP GPA (mu_x 0.9967)": 1.89,
    "DDP GPA (mu_x 0.987)": 1.895,
}


def _ordered(meta, broken=None):
    if meta["key"] != "co2grid":
        return ORDERED[meta["name"]] + (0.1 if meta["name"] == broken else 0.0)
    lag = {"DiLoCo": 0.0, "CO2": 0.005, "CO2 + penalty + clip": 0.02}[meta["name"]]
    lag += 0.05 * (broken == "CO2" and meta["name"] != "DiLoCo" and meta["H"] == 30)
    return 2.0 + lag + 0.01 * abs(meta["lr"] - 0.7) + 0.001 * meta["H"]


@pytest.mark.parametrize(
    "broken, claim",
    [
        (None, None),
        ("SPARTA-DiLoCo H=60 p=1/60", "SPARTA-DiLoCo at twice DiLoCo's H"),
        ("DES-LOC H=30 (3, 6)", "DES-LOC is no worse than Local Adam"),
        ("MuLoCo H=30 (Muon lr x16)", "MuLoCo with 2-bit error-feedback"),
        ("Hierarchical H1=10 K=3", "Hierarchical DiLoCo beats flat DiLoCo"),
        ("DiLoCo H=30 momentum restarts (every 5)", "Restarting the outer momentum"),
        ("DiLoCo H=30 momentum warm-up and decay (10, 10)", "Outer-momentum warm-up"),
        ("DDP GPA (mu_x 0.9967)", "GPA beats AdamW"),
        ("CO2", "CO2 at its best outer lr reaches DiLoCo's best within 0.5% at H = 30"),
    ],
)
@pytest.mark.cases("first", 2)
def test_orderings_targets(broken, claim, tmp_path):
    rows = studies.orderings_rows()
    results = _fake(rows, lambda m: _ordered(m, broken))
    sections, targets, data = orderings_report.orderings_report(rows, results, tmp_path)
    failed = [t.claim for t in targets if t.held is not True]
    if broken is None:
        assert failed == [], failed
    else:  # SPARTA-DiLoCo's row is in two claims; every other break fails one
        assert failed and all(c.startswith(claim) or "SPARTA-DiLoCo" in c for c in failed)
        assert any(c.startswith(claim) for c in failed), failed
    assert data["co2"]["CO2 H=10 lr=0.7"] == pytest.approx(2.015)
    assert any(line.startswith("| CO2 + penalty + clip | 30 |") for line in sections)
    assert (tmp_path / "orderings_co2.png").stat().st_size > 0


@pytest.mark.parametrize("sweep", ["scaling", "eager", "bytes", "orderings"])
@pytest.mark.cases("first", 1)
def test_each_study_runs_end_to_end_at_its_smallest_grid(sweep, tmp_path, capsys):
    out = tmp_path / sweep
    assert compare.main(["--sweep", sweep, "--smoke", "--out", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert report.startswith("# ") and "## Targets" in report and "not run" not in report
    payload = json.loads((out / "study.json").read_text())
    assert payload["data"]
    printed = capsys.readouterr().out
    for target in payload["targets"]:
        assert target["claim"] in printed
    assert list(out.glob("*.png"))


def test_a_study_refuses_a_preset_or_overrides(capsys):
    with pytest.raises(SystemExit) as e:
        compare.main(["--sweep", "eager", "outer.learning_rate=0.5"])
    assert e.value.code == 2
    assert "--sweep eager runs its own grid" in capsys.readouterr().err


def _die(*args, **kwargs):
    os._exit(3)  # as XLA's runtime aborting a worker would


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_a_dead_worker_fails_its_unfinished_rows_and_the_next_call_starts_another(tmp_path):
    with study_run.Workers() as workers:
        with pytest.raises(BrokenProcessPool):
            workers.call(2, _die)
        assert workers.call(2, math.prod, [2, 3]) == 6
        rows = studies.scaling_rows(smoke=True)[:1]
        sweep = [(r.label, list(r.overrides)) for r in rows]
        base = config_lib.preset("cpu-tiny")
        plan = compare.plan_sweep(base, tmp_path, sweep, 2)
        assert study_run.row_devices(plan[0]["runs"][0]["cfg"]) == 2  # DP: 1 x 2 data shards
        sweeper = study_run.Sweeper(_die, compare.plan_sweep, compare.Link, compare.SweepError)
        swept = study_run._run_phase(sweep, plan, base, tmp_path, 2, sweeper, workers)
    assert [r["status"] for r in swept] == ["failed"]
    assert "its worker (2 devices) died" in swept[0]["error"]


def test_a_study_uses_the_devices_its_meshes_span():
    sizes = {r.label: r.overrides for r in studies.scaling_rows(smoke=True)}
    base = config_lib.preset("cpu-tiny")
    for label, overrides in sizes.items():
        cfg = config_lib.override(base, list(overrides))
        assert study_run.row_devices(cfg) == 2, label
    for m, devices in ((1, 2), (2, 2), (4, 4), (8, 8)):
        cfg = config_lib.override(base, studies._mesh(m))
        assert study_run.row_devices(cfg) == devices
        assert cfg.data.batch * m == studies.GLOBAL_BATCH  # the same global batch for every M


# ---------------------------------------------------------------------------------------------
# Table 6's cost model


def _simulated_round_s(step_s, H, comm_s, layers, backward_fraction):
    """The schedule event by event: H - 1 plain steps, then the last one's forward, the
    backward pass layer by layer, and each layer's part of the reduction on the one link as
    soon as its backward is done and the link is free."""
    t = (H - 1) * step_s + (1 - backward_fraction) * step_s
    link_free = t
    for _ in range(layers):
        t += backward_fraction * step_s / layers  # this layer's backward is done
        link_free = max(link_free, t) + comm_s / layers  # its part goes when the link is free
    return max(t, link_free)


def test_layerwise_round_matches_the_event_by_event_schedule():
    rng = np.random.default_rng(0)
    for _ in range(200):
        step = rng.uniform(0.1, 2.0)
        H = int(rng.integers(1, 200))
        comm = step * 10 ** rng.uniform(-3, 2)
        layers = int(rng.integers(1, 96))
        fraction = rng.uniform(0.3, 0.9)
        assert utilization.layerwise_round_s(step, H, comm, layers, fraction) == pytest.approx(
            _simulated_round_s(step, H, comm, layers, fraction), rel=1e-12
        )


def test_table6_grid_and_solutions():
    # every published value lies on the inferred grid (within the paper's rounding)
    for values in utilization.TABLE6_PAPER.values():
        for v in values:
            assert np.min(np.abs(utilization.TABLE6_GRID / v - 1)) < 0.01, v
    for cell in utilization.table6():
        H = 1 if cell["row"] == "DP" else 100
        exact = cell["exact"]
        assert utilization.table6_utilization(exact * 1.0001, H) >= cell["level"]
        assert utilization.table6_utilization(exact * 0.999, H) < cell["level"]
        assert cell["ours"] >= exact and cell["ours"] / exact < 1.21  # the next grid value
        assert cell["held"] == (abs(cell["ours"] / cell["paper"] - 1) <= 0.10)
