"""``python -m experiments.compare`` misused: each bad input is refused in one line on stderr
(status 2, no traceback) before any run starts and with nothing written; what a user would
want to know but is no error is one ``warning:`` line.

Training is replaced by a fake ``experiments.train.train_validated`` and a study's runs by a
``study_run.run_study`` that fails the test if reached, so every test here is quick.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from experiments import checks, compare, report, study_run, train
from experiments import config as config_lib

ROWS = [
    ("DDP", ["outer.algorithm=ddp"]),
    ("DiLoCo", ["outer.algorithm=diloco"]),
    ("CO2", ["outer.algorithm=co2", "outer.learning_rate=1.0", "outer.momentum=0.0"]),
]


class FakeTrain:
    """Stands in for ``train.train_validated``: records each run's config, writes a
    two-round history."""

    def __init__(self):
        self.configs: dict[str, config_lib.Config] = {}

    def __call__(self, cfg, *, resume=False, out_dir=None, stop_after=None, progress=None):
        checks.check_devices(cfg, 8)
        self.configs[cfg.name] = cfg
        out = Path(out_dir)
        out.mkdir(parents=True)
        (out / "config.json").write_text(config_lib.to_json(cfg))
        history = [
            {
                "round": r,
                "tokens": 1024 * r,
                "seconds": 0.01,
                "bytes_total": 1e6 * r,
                "eval_loss": loss,
                "overlapped": False,
            }
            for r, loss in enumerate([2.5, 2.0], 1)
        ]
        return train.Result(history, None, 1.5)


def _no_study(*args, **kwargs):
    pytest.fail("a study started running after a refusal")


@pytest.fixture
def run(monkeypatch, tmp_path, capsys):
    """``run(*argv, rows=ROWS)``: ``compare.main`` in-process on the micro preset (unless
    argv names another or a study) with the fake trainer, into ``tmp_path/out`` unless argv
    names one or ``out=False``; returns ``(status, stderr lines, the fake)``."""

    def go(*argv, rows=ROWS, out=True):
        fake = FakeTrain()
        monkeypatch.setattr(train, "train_validated", fake)
        monkeypatch.setattr(compare, "SWEEP", rows)
        monkeypatch.setattr(report, "_plot", lambda *a, **k: [], raising=False)
        monkeypatch.setattr(study_run, "run_study", _no_study)
        argv = [a.format(tmp=tmp_path) for a in argv]
        if "--sweep" not in argv and "--preset" not in argv:
            argv = ["--preset", "micro", *argv]
        if out and "--out" not in argv:
            argv = [*argv, "--out", str(tmp_path / "out")]
        capsys.readouterr()
        try:
            code = compare.main(argv)
        except SystemExit as e:  # argparse's exit
            code = e.code
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        return code, err, fake

    return go


def _refused(code, err, fake, *needles):
    """Status 2, one line on stderr naming every needle, and no run."""
    assert code == 2, err
    assert len(err) == 1, err
    assert "error" in err[0] and "Traceback" not in err[0]
    for needle in needles:
        assert needle in err[0], (needle, err[0])
    assert fake.configs == {}


# --- 1. --out that cannot be a directory the sweep writes in


def _setup_file(tmp):
    (tmp / "taken").write_text("keep me")
    return "{tmp}/taken", "is a file"


def _setup_under_file(tmp):
    (tmp / "taken").write_text("keep me")
    return "{tmp}/taken/sub", "taken is a file"


def _setup_report_is_dir(tmp):
    (tmp / "out" / "report.md").mkdir(parents=True)
    return "{tmp}/out", "is a directory"


def _setup_broken_link(tmp):
    (tmp / "link").symlink_to(tmp / "nowhere")
    return "{tmp}/link/out", "broken symlink"


@pytest.mark.parametrize(
    "setup", [_setup_file, _setup_under_file, _setup_report_is_dir, _setup_broken_link]
)
@pytest.mark.parametrize("study", [False, True])
def test_out_that_cannot_be_written_is_refused_before_any_run(run, tmp_path, setup, study):
    typed, why = setup(tmp_path)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    sweep = ["--sweep", "eager", "--smoke"] if study else ["--rows", "DDP"]
    code, err, fake = run(*sweep, "--out", typed)
    _refused(code, err, fake, f"--out={typed.format(tmp=tmp_path)!r}", why)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # nothing written
    if (tmp_path / "taken").exists():
        assert (tmp_path / "taken").read_text() == "keep me"


def _unwritable(tmp):
    if os.geteuid() == 0:  # permission bits do not stop root: a virtual file system does
        if not Path("/proc/self").is_dir():
            pytest.skip("needs a directory this user cannot write in")
        return Path("/proc/co2jax-test/out")
    locked = tmp / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    return locked / "new" / "out"


@pytest.mark.parametrize("study", [False, True])
def test_out_under_an_unwritable_directory_is_refused(run, tmp_path, study):
    out = _unwritable(tmp_path)
    sweep = ["--sweep", "bytes", "--smoke"] if study else ["--rows", "DDP"]
    code, err, fake = run(*sweep, "--out", str(out))
    _refused(code, err, fake, f"--out={str(out)!r}", "cannot be written in")
    assert not out.parent.exists()


def test_default_out_under_a_file_names_the_default(run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "results").write_text("keep me")
    code, err, fake = run("--rows", "DDP", out=False)
    _refused(code, err, fake, "--out='results/micro'", "results is a file", "the default --out")
    assert (tmp_path / "results").read_text() == "keep me"


# --- 2. the link's cost model: a senseless number refused in one line, each as typed


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--overlap-slowdown", "-5"),
        ("--overlap-slowdown", "nan"),
        ("--overlap-slowdown", "inf"),
        ("--bandwidth-gbps", "-1"),
        ("--bandwidth-gbps", "0"),
        ("--latency-ms", "nan"),
        ("--latency-ms", "1e999"),
        ("--bandwidth-gbps", "fast"),
    ],
)
def test_link_numbers_are_refused_in_one_line(run, flag, value):
    code, err, fake = run("--rows", "DDP", flag, value)
    _refused(code, err, fake, f"{flag}={value!r}")


def test_an_overlap_slowdown_above_one_is_warned_about(run):
    code, err, _ = run("--rows", "DDP", "--overlap-slowdown", "18.9")
    assert code == 0
    warned = [ln for ln in err if ln.startswith("warning:")]
    assert len(warned) == 1 and "--overlap-slowdown='18.9'" in warned[0], err
    assert "fraction" in warned[0]


def test_overlap_slowdown_says_what_it_is_in_the_help(run, capsys):
    with pytest.raises(SystemExit):
        compare.main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--overlap-slowdown" in help_text and "fraction" in help_text


# --- 3. a command-line override that a row drops is said


def test_a_row_that_sets_an_override_again_is_warned_about(run):
    code, err, fake = run("outer.learning_rate=0.5")
    assert code == 0, err
    warned = [ln for ln in err if ln.startswith("warning:")]
    assert warned == [
        "warning: row 'DDP' runs ddp, which has no outer.learning_rate: the command line's "
        "outer.learning_rate=0.5 does not apply to it",
        "warning: row 'CO2' sets outer.learning_rate=1.0 over the command line's "
        "outer.learning_rate=0.5",
    ], err
    assert fake.configs["micro-diloco"].outer.learning_rate == 0.5
    assert fake.configs["micro-co2"].outer.learning_rate == 1.0


def test_a_row_whose_algorithm_lacks_an_override_is_warned_about(run):
    code, err, fake = run("outer.momentum=0.5")
    assert code == 0, err
    warned = [ln for ln in err if ln.startswith("warning:")]
    assert len(warned) == 2, err
    assert "row 'DDP'" in warned[0] and "ddp" in warned[0] and "outer.momentum=0.5" in warned[0]
    assert "row 'CO2' sets outer.momentum=0.0" in warned[1]
    assert "outer.algorithm" not in " ".join(warned)  # a row switching it is what a row is
    assert fake.configs["micro-diloco"].outer.momentum == 0.5


def test_an_override_no_row_keeps_is_refused(run):
    code, err, fake = run("--rows", "DDP", "outer.momentum=0.5")
    _refused(code, err, fake, "outer.momentum=0.5", "DDP")


def test_an_override_at_the_old_algorithms_default_reaches_the_row(run):
    """DiLoCo's outer learning rate 0.7 typed on the command line: MuLoCo's default is 0.9,
    and switching the algorithm kept only settings that differed from DiLoCo's defaults."""
    rows = [("MuLoCo", ["outer.algorithm=muloco"])]
    code, err, fake = run("outer.learning_rate=0.7", rows=rows)
    assert code == 0, err
    assert fake.configs["micro-muloco"].outer.learning_rate == 0.7


def test_a_preset_fix_replaced_by_a_typed_setting_is_not_warned_about(run):
    rows = [("Streaming DiLoCo", ["outer.algorithm=streaming_diloco", "outer.alpha=0.0"])]
    # micro's fix for the row is outer.tau=0; the command line's outer.tau=0 replaces it
    code, err, fake = run("outer.algorithm=streaming_diloco", "outer.tau=0", rows=rows)
    assert code == 0, err
    assert not [ln for ln in err if ln.startswith("warning:")], err
    assert fake.configs["micro-streaming-diloco"].outer.tau == 0


def test_a_setting_the_presets_algorithm_lacks_is_refused_as_before(run):
    code, err, fake = run("outer.tau=0")  # micro runs diloco, which has no tau
    _refused(code, err, fake, "outer.tau", "diloco has no such setting")


# --- 4. flags that only a study, or only a sweep of rows, uses


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--smoke"], "--smoke"),
        (["--sweep", "all", "--smoke"], "--smoke"),
        (["--sweep", "compression", "--smoke"], "--smoke"),
        (["--sweep", "ablations", "--rows", "DDP"], "--rows"),
        (["--sweep", "compression", "--rows", "DDP"], "--rows"),
        (["--sweep", "eager", "--smoke", "--bandwidth-gbps", "10"], "--bandwidth-gbps"),
        (["--sweep", "scaling", "--latency-ms", "1"], "--latency-ms"),
        (["--sweep", "orderings", "--overlap-slowdown", "0.1"], "--overlap-slowdown"),
        (["--sweep", "eager", "--rows", "DDP"], "--rows"),
        (["--sweep", "eager", "outer.learning_rate=0.5"], "outer.learning_rate=0.5"),
        (["--rows", "DDP,DDP"], "DDP"),
        (["--rows", "DDP", "--out", ""], "--out=''"),
        (["--sweep", "eager", "--smoke", "--out", " "], "--out=' '"),
    ],
)
def test_a_flag_that_would_be_ignored_is_refused(run, argv, named):
    code, err, fake = run(*argv)
    _refused(code, err, fake, named)


# --- 5. duplicate overrides
# depends on experiments/config.py's override refusing a setting given twice (the lead's
# change for the training command; compare's overrides go through config_lib.override)


def test_a_setting_given_twice_is_refused(run):
    code, err, fake = run("--rows", "DDP", "train.rounds=3", "train.rounds=5")
    _refused(code, err, fake, "train.rounds=3", "train.rounds=5")
