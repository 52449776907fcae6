"""Bad input raises a clear error naming the argument and the value, before any compute, and
loses nothing: the library's arguments, the training command's settings, config files,
directories and runs (resume, kills, signals, memory and device estimates).

The same rule for other inputs lives beside this file: files and the tokenizer
(``test_bad_files.py``), the comparison command (``test_bad_compare.py``), the two-step
collective's error feedback (``test_two_step_feedback.py``), TensorBoard after a kill
(``test_resume.py``) and the TPU program's overlap (``test_tpu_aot.py``)."""

from __future__ import annotations

import os

import jax.numpy as jnp
import optax
import pytest

import co2jax
from co2jax import penalties

NESTEROV = optax.sgd(0.7, momentum=0.9, nesterov=True)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: co2jax.co2(0.0, 0.5), "learning_rate=0.0"),
        (lambda: co2jax.co2(-1.0, 0.5), "learning_rate=-1.0"),
        (lambda: co2jax.co2(float("nan"), 0.5), "learning_rate=nan"),
        (lambda: co2jax.co2("1", 0.5), "learning_rate='1'"),
        (lambda: co2jax.co2(1.0, 1.0), "momentum=1.0"),
        (lambda: co2jax.co2(1.0, -0.1), "momentum=-0.1"),
        (lambda: co2jax.co2(1.0, 0.5, clip_threshold=0.0), "clip_threshold=0.0"),
        (lambda: co2jax.co2(1.0, 0.5, clip_threshold=-2), "clip_threshold=-2"),
        (lambda: co2jax.co2(1.0, 0.5, mode="papr"), "mode='papr'"),
        (
            lambda: co2jax.co2(1.0, 0.5, penalty=penalties.gap_aware(), mode="reference_code"),
            "penalty=",
        ),
        (lambda: co2jax.co2(1.0, 0.5, penalty=3.0), "penalty=3.0"),
        (lambda: co2jax.diloco("sgd"), "outer_optimizer='sgd'"),
        (lambda: co2jax.delayed_diloco(NESTEROV, delay=-1), "delay=-1"),
        (lambda: co2jax.delayed_diloco(NESTEROV, delay=1.5), "delay=1.5"),
        (lambda: co2jax.eager_diloco(NESTEROV, delay=0), "delay=0"),
        (lambda: co2jax.eager_diloco(NESTEROV, num_replicas=0), "num_replicas=0"),
        (lambda: co2jax.slowmo(0.0), "inner_learning_rate=0.0"),
        (lambda: co2jax.slowmo(0.1, slow_learning_rate=-1), "slow_learning_rate=-1"),
        (lambda: co2jax.slowmo(0.1, slow_momentum=1.0), "slow_momentum=1.0"),
        (lambda: co2jax.local_updates(optax.sgd(0.1), co2jax.local_sgd(), 0), "sync_every=0"),
        (lambda: co2jax.local_updates(optax.sgd(0.1), co2jax.local_sgd(), 2.0), "sync_every=2.0"),
        (lambda: co2jax.local_updates(optax.sgd(0.1), NESTEROV, 2), "outer="),
        (lambda: co2jax.local_updates("adam", co2jax.local_sgd(), 2), "inner='adam'"),
        (lambda: co2jax.data_parallel(None), "inner=None"),
        (lambda: co2jax.local_sgd(axis_name=""), "axis_name=''"),
        (lambda: penalties.constant(0.0), "lam=0.0"),
        (lambda: penalties.gap_aware(decay=1.0), "decay=1.0"),
    ],
)
def test_bad_arguments_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(".", r"\.")):
        call()


def test_reference_code_mode_warns_that_clip_is_ignored():
    with pytest.warns(UserWarning, match="no-op"):
        outer = co2jax.co2(1.0, 0.5, clip_threshold=1.0, mode="reference_code")
    assert not outer.overlapped  # the released code averages synchronously


@pytest.mark.parametrize(
    "outer",
    [co2jax.local_sgd(), co2jax.co2(1.0, 0.5), co2jax.eager_diloco(NESTEROV)],
    ids=["local_sgd", "co2", "eager"],
)
def test_sync_outside_the_replica_axis_says_how_to_run_it(outer):
    params = jnp.zeros(3)
    with pytest.raises(NameError, match=r"jax\.vmap\(fn, axis_name='replica'\).*shard_map"):
        outer.sync(params, outer.init(params))


def test_data_parallel_outside_the_replica_axis():
    opt = co2jax.data_parallel(optax.sgd(0.1))
    with pytest.raises(NameError, match="replica"):
        opt.update(jnp.ones(2), opt.init(jnp.ones(2)), jnp.ones(2))


def test_adapter_without_params():
    tx = co2jax.local_updates(optax.sgd(0.1), co2jax.local_sgd(), 2)
    with pytest.raises(ValueError, match="params"):
        tx.update(jnp.ones(2), tx.init(jnp.ones(2)))


# --- runs of the training driver: nothing lost, nothing silent (experiments/train.py) ---------


@pytest.fixture(scope="module", autouse=True)
def _one_program():
    """The runs below share one compiled round (their configs differ only in directories and
    names: ``programs.shared_programs``); nothing here patches a trainer."""
    from experiments import programs

    with programs.shared_programs():
        yield


def _run_cfg(tmp_path, *overrides):
    from experiments import config as config_lib

    return config_lib.override(
        config_lib.preset("micro"),
        [f"log.dir={tmp_path / 'logs'}", "log.tensorboard=false", *overrides],
    )


def _digests(root):
    """Every file under ``root`` by its SHA-256: what a refused command must leave as it was."""
    import hashlib

    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize("made", [False, True], ids=["missing", "empty"])
def test_resume_with_no_checkpoint_says_it_starts_at_round_0(made, tmp_path, capsys):
    """Before: ``--resume`` with a missing or empty checkpoint.dir trained from round 0 with
    no word. Now it says so in one line, and trains (a scheduler that always passes --resume
    starts a new run this way)."""
    from experiments import train

    if made:
        (tmp_path / "ckpt").mkdir()
    cfg = _run_cfg(tmp_path, f"checkpoint.dir={tmp_path / 'ckpt'}", "train.rounds=2")
    history = train.train(cfg, resume=True).history
    assert [r["round"] for r in history] == [1, 2]
    err = capsys.readouterr().err
    assert f"--resume: checkpoint.dir={tmp_path / 'ckpt'} holds no checkpoint: round 0" in err


def test_another_runs_checkpoints_of_another_shape_are_named_as_another_runs(tmp_path, capsys):
    """Before: a new run name resumed from another run's checkpoints of another model shape
    said 'checkpoint step 2 is unusable (... tree structures do not match)' for intact
    checkpoints, then 'no kept checkpoint could be restored'. Now the checkpoints' identity is
    read before their state: another run's, its id and the fields that differ, in one line."""
    import json

    from experiments import rundir, train

    ckpt = f"checkpoint.dir={tmp_path / 'ckpt'}"
    train.train(_run_cfg(tmp_path, ckpt, "train.rounds=2", "checkpoint.every=1"))
    first = json.loads((tmp_path / "logs" / "micro" / rundir.RUN_FILE).read_text())["run_id"]
    before = _digests(tmp_path)
    other = _run_cfg(tmp_path, ckpt, "train.rounds=2", "name=wide", "model.d_model=64")
    with pytest.raises(train.RunError) as refused:
        train.train(other, resume=True)
    message = str(refused.value)
    assert "\n" not in message and f"holds run {first}'s checkpoints" in message
    assert "model: " in message or "d_model" in message
    assert "unusable" not in capsys.readouterr().err
    assert _digests(tmp_path) == before and not (tmp_path / "logs" / "wide").exists()


def test_a_resumed_run_says_which_round_it_resumed_from(tmp_path, capsys):
    from experiments import train

    cfg = _run_cfg(
        tmp_path, f"checkpoint.dir={tmp_path / 'ckpt'}", "train.rounds=2", "checkpoint.every=1"
    )
    train.train(cfg, stop_after=1)
    capsys.readouterr()
    assert [r["round"] for r in train.train(cfg, resume=True).history] == [2]
    assert f"resumed from round 1 of 2 (checkpoint.dir={tmp_path / 'ckpt'})" in (
        capsys.readouterr().err
    )


def test_a_run_that_fails_before_its_first_round_leaves_nothing_behind(tmp_path, monkeypatch):
    """Before: a run that failed after validation (a compile error in its first round, a full
    disk, say) left config.json, run.json and an empty metrics.jsonl, and the same command
    was then refused ('already holds a run'). Now the run directory goes with the failure,
    and the command runs again as it is."""
    from experiments import rundir, train

    def failing(self, record):
        raise OSError(28, "No space left on device")

    cfg = _run_cfg(tmp_path, f"checkpoint.dir={tmp_path / 'ckpt'}", "train.rounds=2")
    with monkeypatch.context() as patch:
        patch.setattr(rundir.Writers, "write", failing)
        with pytest.raises(OSError, match="No space left"):
            train.train(cfg)
    assert not (tmp_path / "logs" / "micro").exists()
    assert [r["round"] for r in train.train(cfg).history] == [1, 2]  # no --overwrite needed


def test_overwrite_never_deletes_what_is_not_a_run(tmp_path):
    """``--overwrite`` deleted checkpoint.dir whole: pointed at a folder holding the user's
    corpus, it would have deleted the corpus. A directory holding files no run writes is
    refused in one line, and left as it was."""
    from experiments import train

    data = tmp_path / "data"
    data.mkdir()
    (data / "corpus.bin").write_bytes(b"\x01\x02" * 64)
    before = _digests(tmp_path)
    cfg = _run_cfg(tmp_path, f"checkpoint.dir={data}", "train.rounds=1")
    with pytest.raises(train.RunError, match=r"checkpoint\.dir .*data holds files that are not"):
        train.train(cfg, overwrite=True)
    assert _digests(tmp_path) == before


def _main(capsys, *argv):
    """The training command in this process: ``(exit status, stderr's lines)``."""
    from experiments import train

    capsys.readouterr()
    try:
        train.main(list(argv))
        code = 0
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err.strip().splitlines()


def test_an_override_given_twice_is_refused(tmp_path, capsys):
    """Before: the last of two overrides of one setting won, silently."""
    code, err = _main(
        capsys, "--preset", "micro", f"log.dir={tmp_path}", "train.rounds=3", "train.rounds=5"
    )
    assert code == 2 and err == [
        "error: train.rounds=5: set twice ('train.rounds=3', then 'train.rounds=5'): give it once"
    ]
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "name, text, line",
    [
        (
            "run.yaml",
            "train:\n  rounds: 2\ntrain:\n  sync_every: 3\n",
            "line 3: train is set twice",
        ),
        ("run.yaml", "train:\n  rounds: 2\n  rounds: 3\n", "line 3: train.rounds is set twice"),
        ("run.json", '{"train": {"rounds": 2, "rounds": 3}}', "'rounds' is set twice"),
    ],
    ids=["yaml-section", "yaml-key", "json-key"],
)
def test_a_config_file_key_given_twice_is_refused(name, text, line, tmp_path, capsys):
    """Before: YAML and JSON kept the last value of a key set twice (a second ``train:``
    section replaced the first whole), silently."""
    path = tmp_path / name
    path.write_text(text)
    code, err = _main(capsys, "--preset", "micro", "--config", str(path), "--print-config")
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: --config='{path}': {line}")


def test_a_config_file_type_error_shows_the_files_own_words(tmp_path, capsys):
    """Before: ``rounds: yes`` was refused as ``train.rounds=True: expected int``, with no word
    of the file; now the file, its line and its text are named."""
    path = tmp_path / "run.yaml"
    path.write_text("# my run\ntrain:\n  rounds: yes\n")
    code, err = _main(capsys, "--preset", "micro", "--config", str(path), "--print-config")
    assert code == 2
    assert err == [f"error: train.rounds=True: expected int (in {path}, line 3: rounds: yes)"]


def test_an_inner_warm_up_longer_than_the_run_is_warned_about(tmp_path, capsys):
    code, err = _main(
        capsys, "--preset", "micro", "--print-config", "inner.warmup_steps=50", "train.rounds=3"
    )
    assert code == 0
    assert err == [
        "warning: inner.warmup_steps=50: longer than the run (train.rounds=3 x "
        "train.sync_every=2 = 6 inner steps): the learning rate warms up for the whole run "
        "and never reaches inner.learning_rate=0.003"
    ]


@pytest.mark.parametrize(
    "override, why",
    [
        ("log.dir=/proc/co2jax-nope", "/proc, where it would be made, cannot be written in"),
        ("checkpoint.dir=/proc/co2jax-nope", "/proc, where it would be made, cannot be"),
        ("log.dir={file}/logs", "is a file, not a directory"),
    ],
    ids=["log-dir-proc", "checkpoint-dir-proc", "log-dir-under-a-file"],
)
def test_a_directory_that_cannot_be_made_is_refused_in_one_line(override, why, tmp_path, capsys):
    """Before: log.dir=/proc/... ended in a FileNotFoundError traceback, /sys/... in a
    PermissionError (root passes every permission check: the driver now tries for real)."""
    file = tmp_path / "a-file"
    file.write_text("x")
    override = override.format(file=file)
    logs = [] if override.startswith("log.dir") else [f"log.dir={tmp_path / 'logs'}"]
    code, err = _main(capsys, "--preset", "micro", *logs, override)
    assert code == 2 and len(err) == 1 and why in err[0], err
    assert err[0].startswith(f"error: {override}: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_run_outputs_inside_the_data_directory_are_refused(tmp_path, capsys):
    """A run directory or checkpoint directory inside a ``data.kind=text`` folder: the next
    run would read the metrics and checkpoints as text, and --overwrite would delete data."""
    data = tmp_path / "texts"
    data.mkdir()
    (data / "a.txt").write_text("some text to train on\n" * 50)
    before = _digests(tmp_path)
    common = ["--preset", "micro", "data.kind=text", f"data.path={data}", "data.vocab_size=256"]
    code, err = _main(capsys, *common, f"log.dir={data / 'logs'}")
    assert code == 2 and "lies inside the data.path directory" in err[0] and len(err) == 1
    code, err = _main(capsys, *common, f"log.dir={tmp_path}", f"checkpoint.dir={data}")
    assert code == 2 and f"error: checkpoint.dir={data}: is the data.path directory" in err[0]
    assert _digests(tmp_path) == before


def test_a_round_that_cannot_fit_is_refused_before_it_compiles(tmp_path):
    """Before: data.seq_len=100000 compiled for 30 s, then failed to allocate 2.6 TB. Now a
    lower bound of the round's memory (experiments.footprint) refuses it first."""
    from experiments import checks, programs

    cfg = checks.load("micro", [f"log.dir={tmp_path}", "data.seq_len=100000"])
    with pytest.raises(
        ValueError, match=r"^data\.seq_len=100000: a round needs at least [\d,.]+ GiB"
    ):
        programs.build_validated(cfg)
    assert not any(tmp_path.iterdir())


def test_too_many_emulated_devices_are_refused_before_jax_starts(tmp_path):
    """Before: mesh.replica=1000 emulated 2,000 CPU devices and aborted (SIGABRT) after about
    100 s. The command refuses it in one line, before JAX's backend starts."""
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-m", "experiments.train", "--preset", "micro", f"log.dir={tmp_path}",
         "mesh.replica=1000"],
        cwd=root, env={**env, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: mesh.replica=1000: mesh.replica=1000 x mesh.data=2 x mesh.model=1 needs 2000 "
        "devices: more than the 256 CPU devices the driver emulates (XLA's CPU collectives wait "
        "for a thread per device: 512 aborted here); run fewer replicas, use accelerators, or "
        "set JAX_NUM_CPU_DEVICES"
    ]


def test_a_mesh_that_does_not_fit_says_where_the_device_count_came_from(tmp_path):
    """Before: ``mesh.replica=3`` said only that 6 devices do not fit 8. The command now
    emulates what the mesh needs (6); where the count is fixed (here: this test process's 8
    devices), the one line says by what, and how to get another count."""
    from experiments import checks, programs

    assert checks.emulated_devices(checks.load("micro", ["mesh.replica=3"])) == 6
    cfg = checks.load("micro", [f"log.dir={tmp_path}", "mesh.replica=3"])
    with pytest.raises(ValueError) as refused:
        programs.build_validated(cfg)
    assert str(refused.value).startswith(
        "mesh.replica=3: mesh.replica=3 x mesh.data=2 x mesh.model=1 needs 6 devices; this "
        "process has 8 CPU devices, fixed"
    )
    assert "JAX_NUM_CPU_DEVICES" in str(refused.value)


def test_make_mesh_on_too_few_cpu_devices_names_the_variable():
    import jax

    with pytest.raises(ValueError, match=r"JAX_NUM_CPU_DEVICES=8 in the environment"):
        co2jax.make_mesh(replica=4, data=2, devices=jax.devices()[:2])


@pytest.mark.parametrize("driver", ["round_engine", "local_updates"])
def test_gpa_under_an_outer_step_is_refused_by_the_library(driver):
    """Before: co2jax.gpa as the inner transform of DiLoCo ran silently (the outer step moves
    the parameters, GPA's z stays behind); the experiments config refused it, the library did
    not. Data parallel GPA (no outer step) still runs."""
    import jax

    params = {"w": jnp.zeros(3)}
    outer = co2jax.diloco(optax.sgd(0.7))
    if driver == "round_engine":
        mesh = co2jax.make_mesh(replica=4, data=2)
        loss = lambda p, b: jnp.mean((b @ p["w"]) ** 2)
        trainer = co2jax.RoundTrainer(loss, co2jax.gpa(1e-2), outer, mesh, sync_every=2)
        with pytest.raises(ValueError, match=r"^inner=co2jax\.gpa\(\.\.\.\): GPA keeps"):
            trainer.init(params)
        ddp = co2jax.RoundTrainer(
            loss, co2jax.data_parallel(co2jax.gpa(1e-2)), co2jax.no_sync(), mesh, sync_every=2
        )
        assert jax.tree.leaves(ddp.init(params))
    else:
        tx = co2jax.local_updates(co2jax.gpa(1e-2), outer, sync_every=2)
        with pytest.raises(ValueError, match=r"^inner=co2jax\.gpa\(\.\.\.\): GPA keeps"):
            tx.init(params)
        chained = co2jax.local_updates(optax.chain(optax.clip(1.0), co2jax.gpa(1e-2)), outer, 2)
        with pytest.raises(ValueError, match="GPA keeps its own iterate"):
            chained.init(params)


def _interrupted_start_ups(tmp_path, moments, command="train"):
    """Starts the training (or comparison) command once per moment, all at once, sends each
    SIGINT that many seconds after its start, and returns each ``(moment, exit status,
    stderr)``. A run starts when its process has become the Python that runs the command
    (its ``exec``): a signal sent between the fork and the exec is caught by the handler the
    child copied from this process and lost with it (under load, a moment of 0.12 s fell
    there: the run went on and exited 0), and no Ctrl-C reaches a command before its shell
    has started it."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    runs = []
    for i, moment in enumerate(moments):
        argv = [sys.executable, "-m", f"experiments.{command}", "--preset", "micro"]
        if command == "train":
            argv += [f"log.dir={tmp_path / str(i)}", "train.rounds=2"]
        else:
            argv += ["--rows", "DDP", "--out", str(tmp_path / str(i))]
        proc = subprocess.Popen(argv, cwd=root, env=env, stderr=subprocess.PIPE, text=True)
        cmdline = Path(f"/proc/{proc.pid}/cmdline")
        while proc.poll() is None and b"experiments." not in cmdline.read_bytes():
            time.sleep(0.001)  # not exec'd yet: still a copy of this process
        runs.append((time.monotonic() + moment, moment, proc))
    for at, _, proc in sorted(runs, key=lambda r: r[0]):
        time.sleep(max(0.0, at - time.monotonic()))
        proc.send_signal(signal.SIGINT)
    out = []
    for _, moment, proc in runs:
        err = proc.communicate(timeout=300)[1]
        out.append((moment, proc.returncode, err))
    return out


def _check_none_lost(results):
    """Each run stopped: status 130 after saying so (the handler was in), or Python's own
    KeyboardInterrupt (a signal before the command's first line ran); never a full run."""
    import signal

    for moment, code, err in results:
        assert code in (128 + signal.SIGINT, -signal.SIGINT), (moment, code, err[-400:])
        if code == 128 + signal.SIGINT and "co2jax compare" not in err:
            assert "SIGINT: stopped after round" in err, (moment, err[-400:])


def test_ctrl_c_during_start_up_is_never_lost(tmp_path):
    """Before: 4 of 10 SIGINTs sent during start-up were raised inside JAX's garbage-collection
    callback while JAX loaded, printed as 'Exception ignored' and dropped, and the run trained
    to its end with exit 0. The command installs its handlers before JAX is imported. Three
    moments here, while JAX loads; a random sample of many with -m slow."""
    _check_none_lost(_interrupted_start_ups(tmp_path, [0.4, 1.2, 2.4]))


@pytest.mark.slow  # 16 processes (about a minute on 2 cores); three moments run by default
def test_ctrl_c_at_random_moments_of_start_up_is_never_lost(tmp_path):
    import random

    rng = random.Random(45)
    moments = sorted(rng.uniform(0.05, 6.0) for _ in range(16))
    results = []
    for first in range(0, len(moments), 4):  # four at a time
        results += _interrupted_start_ups(tmp_path / str(first), moments[first : first + 4])
    _check_none_lost(results)
    # the comparison sweep too: it installs the same handlers on its first line
    _check_none_lost(_interrupted_start_ups(tmp_path / "compare", [0.5, 1.5, 3.0], "compare"))
