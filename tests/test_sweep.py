"""experiments.compare as a sweep its users can trust: rows validated before anything runs,
finished rows reused by config hash, the report rewritten after every row, failures and
Ctrl-C recorded, plots that tell the rows apart.

Training is replaced by a fake ``experiments.train.train_validated`` (what the sweep calls once per
run), so every test here takes well under a second of compute.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import signal
from pathlib import Path

import pytest

from experiments import checks, compare, report, sweep_rows, train
from experiments import config as config_lib

ROWS = [
    ("DDP", ["outer.algorithm=ddp"]),
    ("DiLoCo", ["outer.algorithm=diloco"]),
    ("CO2", ["outer.algorithm=co2", "outer.momentum=0.0"]),
]


class FakeTrain:
    """Stands in for ``train.train_validated``: checks the mesh and counts the call, refuses a run
    directory that holds anything (as the driver does without ``overwrite``), writes the
    config there, returns a two-round history (DDP sends 16x the bytes of the others), and
    raises ``fail[k]`` on the k-th call (1-based)."""

    def __init__(self, fail=None, on_call=None, curves=None):
        self.calls: list[str] = []
        self.fail = fail or {}
        self.on_call = on_call
        self.curves = curves or {}

    def __call__(self, cfg, *, resume=False, out_dir=None, stop_after=None, progress=None):
        checks.check_devices(cfg, 8)  # the driver's check before it builds anything
        self.calls.append(cfg.name)
        k = len(self.calls)
        if self.on_call is not None:
            self.on_call(k, cfg, Path(out_dir))
        out = Path(out_dir)
        if out.exists() and any(out.iterdir()):
            raise RuntimeError(f"{out} already holds a run")
        if k in self.fail:
            raise self.fail[k]
        out.mkdir(parents=True)
        (out / "config.json").write_text(config_lib.to_json(cfg))
        ddp = cfg.outer.algorithm == "ddp"
        final = 2.0 + 0.01 * k
        losses = self.curves.get(cfg.name.split("-", 1)[1], [final + 0.5, final])
        history = [
            {
                "round": r,
                "tokens": 1024 * r,
                "seconds": 0.01,
                "bytes_total": (16e6 if ddp else 1e6) * r,
                "eval_loss": loss,
                "overlapped": False,
            }
            for r, loss in enumerate(losses, 1)
        ]
        return train.Result(history, None, 1.5)


@pytest.fixture
def sweep(monkeypatch, tmp_path):
    """Runs ``compare.main`` on ``rows`` of the micro preset with a fake trainer; the plots are
    stubbed (counted) unless ``plots=True``."""
    out = tmp_path / "out"
    plotted = []
    real_plot = getattr(report, "_plot", None)

    def fake_plot(rows, base, out_dir, tokens):
        plotted.append(len(rows))
        return []

    def run(rows=ROWS, fake=None, *args, plots=False):
        fake = fake if fake is not None else FakeTrain()
        monkeypatch.setattr(train, "train_validated", fake)
        monkeypatch.setattr(compare, "SWEEP", rows)
        monkeypatch.setattr(report, "_plot", real_plot if plots else fake_plot, raising=False)
        argv = ["--preset", "micro", "--out", str(out), *args, f"log.dir={tmp_path / 'logs'}"]
        try:
            code = compare.main(argv)
        except KeyboardInterrupt:
            pytest.fail("KeyboardInterrupt escaped compare.main")
        except SystemExit as e:  # argparse's exit(2) and a main that exits itself
            code = e.code
        return 0 if code is None else code, fake  # None: exit status 0

    run.out = out
    run.real_plot = real_plot
    run.plotted = plotted
    return run


def _table(text: str) -> dict[str, str]:
    """The report's table: label -> the whole line."""
    return {ln.split("|")[1].strip(): ln for ln in text.splitlines() if ln.startswith("| ")}


def test_invalid_row_is_refused_before_any_run(sweep, capsys):
    rows = [*ROWS, ("Bad momentum", ["outer.algorithm=diloco", "outer.momentum=1.0"])]
    code, fake = sweep(rows)
    assert code == 2
    assert fake.calls == []  # not one run started
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1, err
    assert "Bad momentum" in err[0] and "outer.momentum=1.0" in err[0]
    assert not (sweep.out / "report.md").exists()


def test_micro_preset_sweep_is_valid_up_front(sweep):
    """The preset ``--help`` offers: every row of the full sweep validates (it died at
    Streaming DiLoCo's tau after 10 runs)."""
    code, fake = sweep(sweep_rows.SWEEP)
    assert code == 0
    assert len(fake.calls) == len(sweep_rows.SWEEP)
    table = _table((sweep.out / "report.md").read_text())
    assert all(label in table for label, _ in sweep_rows.SWEEP)


def test_finished_rows_are_reused_unless_rerun(sweep):
    code, fake = sweep()
    assert code == 0 and len(fake.calls) == 3
    first = (sweep.out / "report.md").read_text()
    code, fake = sweep()
    assert code == 0 and fake.calls == []  # every row's result matches its config hash
    table = _table((sweep.out / "report.md").read_text())
    assert all("reused" in table[label] for label, _ in ROWS)
    assert _table(first)["DDP"].split("|")[2] == table["DDP"].split("|")[2]  # same eval loss
    code, fake = sweep(ROWS, None, "--rerun")
    assert code == 0 and len(fake.calls) == 3
    # a changed row config (its hash) reruns that row only
    changed = [ROWS[0], ("DiLoCo", ["outer.algorithm=diloco", "outer.learning_rate=0.5"]), ROWS[2]]
    code, fake = sweep(changed)
    assert code == 0 and fake.calls == ["micro-diloco"]


def test_config_hash_is_the_canonical_json():
    cfg = config_lib.override(config_lib.preset("micro"), ["outer.algorithm=co2"])
    canonical = json.dumps(config_lib.to_dict(cfg), sort_keys=True, separators=(",", ":"))
    assert compare.config_hash(cfg) == hashlib.sha256(canonical.encode()).hexdigest()[:16]
    # stable: the same config read back from its saved JSON hashes the same
    again = config_lib.from_dict(json.loads(config_lib.to_json(cfg)))
    assert compare.config_hash(again) == compare.config_hash(cfg)
    assert compare.config_hash(cfg) != compare.config_hash(
        config_lib.override(cfg, ["outer.learning_rate=0.5"])
    )


def test_report_is_rewritten_after_each_row_and_a_failed_row_is_recorded(sweep):
    seen = {}

    def on_call(k, cfg, run_dir):
        if k == 3:  # row 3 starts: the report already has rows 1 and 2
            seen["report"] = (sweep.out / "report.md").read_text()

    fake = FakeTrain(fail={2: RuntimeError("boom\n  on a second line")}, on_call=on_call)
    code, fake = sweep(ROWS, fake)
    assert code == 1  # a row failed
    assert len(fake.calls) == 3  # the sweep went on to row 3
    during = _table(seen["report"])
    assert re.search(r"\| DDP \| 2\.0100 \|", during["DDP"])
    assert "failed: RuntimeError: boom on a second line" in during["DiLoCo"]
    assert "not run" in during["CO2"]
    assert sweep.plotted[:2] == [3, 3]  # the plots too, after rows 1 and 2
    final = _table((sweep.out / "report.md").read_text())
    assert "RuntimeError: boom" in final["DiLoCo"] and re.search(r"\| CO2 \| 2\.0300", final["CO2"])
    # the failed row is not cached: the next invocation runs it (and only it) again
    code, fake = sweep(ROWS)
    assert code == 0 and fake.calls == ["micro-diloco"]


@pytest.mark.parametrize("how", ["keyboard_interrupt", "driver_stop"])
def test_keyboard_interrupt_leaves_a_partial_report_and_exits_130(sweep, how):
    if how == "keyboard_interrupt":
        stop = KeyboardInterrupt()
    elif hasattr(train, "Interrupted"):  # the driver's stop at a round's end on SIGINT
        stop = train.Interrupted(signal.SIGINT, 1, None)
    else:
        pytest.skip("this training driver has no Interrupted")
    code, fake = sweep(ROWS, FakeTrain(fail={2: stop}))
    assert code == 130
    assert len(fake.calls) == 2
    text = (sweep.out / "report.md").read_text()
    table = _table(text)
    assert re.search(r"\| DDP \| 2\.0100 \|", table["DDP"])
    assert "not run" in table["DiLoCo"] and "not run" in table["CO2"]
    assert "Interrupted" in text
    summary = json.loads((sweep.out / "summary.json").read_text())
    assert [r["status"] for r in summary] == ["done", "not run", "not run"]
    # a second invocation reuses row 1 and runs the other two
    code, fake = sweep(ROWS)
    assert code == 0 and fake.calls == ["micro-diloco", "micro-co2"]


def test_ratios_print_as_one_over_n(sweep):
    assert [report.format_ratio(x) for x in (1.0, 0.0625, 1 / 124, 0.53, 0.0)] == [
        "1",
        "1/16",
        "1/124",
        "1/1.9",
        "0",
    ]
    code, _ = sweep()
    assert code == 0
    table = _table((sweep.out / "report.md").read_text())
    assert "| 1/16 |" in table["DiLoCo"] and "| 1 |" in table["DDP"]
    assert "0.0625" not in table["DiLoCo"]


def test_report_shows_hyper_parameters_with_config_links_and_cites_only_repository_files(sweep):
    code, _ = sweep()
    assert code == 0
    text = (sweep.out / "report.md").read_text()
    assert "ALGORITHMS.md" not in text
    for label, overrides in ROWS:
        (line,) = [ln for ln in text.splitlines() if ln.startswith(f"- **{label}**")]
        assert all(o in line for o in overrides)
        (link,) = re.findall(r"\[config\]\(([^)]+)\)", line)
        assert not Path(link).is_absolute()
        saved = json.loads((sweep.out / link).read_text())
        assert saved["outer"]["algorithm"] == overrides[0].split("=")[1]
    for page in set(re.findall(r"docs/algorithms/\w+\.md", text)):
        assert (report.REPO / page).exists()


def test_plots_tell_13_rows_apart_and_keep_the_informative_band(sweep, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    rows = [
        (f"Row {i}", ["outer.algorithm=diloco", f"outer.learning_rate={0.1 + i / 100}"])
        for i in range(13)
    ]
    curves = {"row-11": [3.0, 50.0], "row-12": [3.0, float("nan")]}  # diverged, non-finite
    code, _ = sweep(rows, FakeTrain(curves=curves))
    assert code == 0
    summary = json.loads((sweep.out / "summary.json").read_text())
    base = config_lib.preset("micro")

    figures = []
    real_savefig = Figure.savefig

    def spy(fig, *args, **kwargs):
        fig.canvas.draw()
        (ax,) = [a for a in fig.axes if a.get_visible()]  # one family: one facet
        lines = [ln for ln in ax.get_lines() if not ln.get_label().startswith("entropy floor")]
        figures.append(
            {
                "styles": [(ln.get_color(), ln.get_linestyle()) for ln in lines],
                "labels": [ln.get_label() for ln in lines],
                "title": fig.get_suptitle(),
                "facet": ax.get_title(),
                "ylim": ax.get_ylim(),
                "legend": ax.get_legend() is not None,
            }
        )
        return real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(report, "_plot", sweep.real_plot, raising=False)  # the real plots
    monkeypatch.setattr(Figure, "savefig", spy)
    report.write_report(summary, base, sweep.out, sweep_rows.Link())
    assert len(figures) == 3
    for f in figures:
        assert len(f["styles"]) == 13
        assert len(set(f["styles"])) == 13  # no colour + line style pair repeated
        assert "micro" in f["title"] and "R=4" in f["title"] and "H=2" in f["title"]
        assert "tokens" in f["title"]
        lo, hi = f["ylim"]
        assert math.isfinite(lo) and math.isfinite(hi) and hi < 10  # not scaled by the 50
        assert lo <= 2.01 and 2.11 <= hi  # the finished rows' finals (2.01-2.11) in view
        assert hi - lo < 1.0  # the band, not the whole descent
        assert any("Row 11" in lb and "diverged" in lb for lb in f["labels"])
        assert any("Row 12" in lb and "non-finite" in lb for lb in f["labels"])
        assert f["legend"] and f["facet"] == "synchronous and periodic"
    assert all(len({(c, s) for c, s, _ in report.plot_styles(n)}) == n for n in (13, 25, 40))
