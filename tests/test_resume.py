"""Runs that cannot be misused: one config per run directory, checked resumes, verified
checkpoints with fallback, clean stops on signals and on divergence."""

from __future__ import annotations

import json
import os
import signal

import jax
import numpy as np
import pytest

from experiments import checkpoints, rundir, train
from experiments import config as config_lib
from experiments import files as files_lib


def _cfg(tmp_path, *overrides, ckpt=True):
    extra = [f"checkpoint.dir={tmp_path / 'ckpt'}"] if ckpt else []
    return config_lib.override(
        config_lib.preset("micro"),
        [f"log.dir={tmp_path / 'logs'}", "log.tensorboard=false", *extra, *overrides],
    )


def _run_dir(tmp_path):
    return tmp_path / "logs" / "micro"


def _snapshot(root):
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() else None
        for p in sorted(root.rglob("*"))
    }


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_a_used_run_directory_is_refused_before_anything_is_written(tmp_path):
    train.train(_cfg(tmp_path, "train.rounds=1"))
    before = _snapshot(tmp_path)
    why = r"already holds a run \(last logged round: 1\): pass --resume"
    with pytest.raises(train.RunError, match=why):
        train.train(_cfg(tmp_path, "train.rounds=1", "outer.algorithm=co2"))
    assert _snapshot(tmp_path) == before  # config, metrics and checkpoints untouched


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_overwrite_replaces_the_old_run(tmp_path):
    train.train(_cfg(tmp_path, "train.rounds=2"))
    result = train.train(_cfg(tmp_path, "train.rounds=1", "outer.algorithm=co2"), overwrite=True)
    assert [r["round"] for r in result.history] == [1]
    lines = (_run_dir(tmp_path) / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1
    assert (
        json.loads((_run_dir(tmp_path) / "config.json").read_text())["outer"]["algorithm"] == "co2"
    )
    assert checkpoints.Checkpoints(tmp_path / "ckpt", 2).steps() == [1]


def test_a_checkpoint_directory_of_another_run_is_refused(tmp_path):
    train.train(_cfg(tmp_path, "train.rounds=1"))
    with pytest.raises(train.RunError, match="ckpt already holds a run"):
        train.train(_cfg(tmp_path, "train.rounds=1", "name=other"))
    assert not (tmp_path / "logs" / "other").exists()


def test_resume_without_a_checkpoint_dir_is_an_error(tmp_path):
    with pytest.raises(train.RunError, match=r"checkpoint\.dir is not set"):
        train.train(_cfg(tmp_path, ckpt=False), resume=True)
    assert not (tmp_path / "logs").exists()


def test_resume_with_another_config_names_the_fields_and_writes_nothing(tmp_path):
    train.train(_cfg(tmp_path, "train.rounds=2"), stop_after=1)
    before = _snapshot(tmp_path)
    named = r"inner.learning_rate: 0.003 -> 0.01; outer.algorithm: 'diloco' -> 'co2'"
    with pytest.raises(train.RunError, match=named):
        train.train(
            _cfg(tmp_path, "train.rounds=2", "outer.algorithm=co2", "inner.learning_rate=0.01"),
            resume=True,
        )
    assert _snapshot(tmp_path) == before


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_another_runs_checkpoints_are_refused_in_one_line(tmp_path, capsys):
    """A run with another seed pointed at this run's checkpoint directory (its own log
    directory) was restored silently; now each checkpoint records its run's id and trajectory
    fields, and the resume is refused naming them, unless continued deliberately."""
    train.train(_cfg(tmp_path, "train.rounds=3", "checkpoint.every=1"), stop_after=2)
    stored = json.loads((_run_dir(tmp_path) / rundir.RUN_FILE).read_text())
    assert stored["trajectory"]["train"]["seed"] == 0 and len(stored["run_id"]) == 12
    other = _cfg(tmp_path, "train.rounds=3", "checkpoint.every=1", "train.seed=1", "name=b")
    before = _snapshot(tmp_path)
    with pytest.raises(train.RunError) as refused:
        train.train(other, resume=True)
    message = str(refused.value)
    assert message.startswith("--resume: checkpoint.dir=") and "\n" not in message
    assert "train.seed: 0 -> 1" in message and "--allow-config-change" in message
    assert _snapshot(tmp_path) == before  # nothing written
    # the same trajectory from another log directory: the checkpoints are its own run's
    same = _cfg(tmp_path, "train.rounds=3", "checkpoint.every=1", "name=c")
    assert [r["round"] for r in train.train(same, resume=True).history] == [3]
    # deliberately: continues, says so, and the run carries its own identity on
    longer = _cfg(tmp_path, "train.rounds=4", "checkpoint.every=1", "train.seed=1", "name=b")
    deliberate = train.train(longer, resume=True, allow_config_change=True)
    assert [r["round"] for r in deliberate.history] == [4]  # from the latest checkpoint (3)
    assert "warning: --allow-config-change" in capsys.readouterr().err
    mine = json.loads((tmp_path / "logs" / "b" / rundir.RUN_FILE).read_text())
    assert mine["run_id"] != stored["run_id"] and mine["trajectory"]["train"]["seed"] == 1


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_a_resumed_run_refuses_checkpoints_of_another_run_id(tmp_path):
    """The same config run twice (the second with --overwrite), and the first run's
    checkpoints put back in place of the second's: not the second run's to continue."""
    import shutil

    cfg = _cfg(tmp_path, "train.rounds=2", "checkpoint.every=1")
    train.train(cfg, stop_after=1)
    first = json.loads((_run_dir(tmp_path) / rundir.RUN_FILE).read_text())["run_id"]
    shutil.copytree(tmp_path / "ckpt", tmp_path / "first-ckpt")
    train.train(cfg, stop_after=1, overwrite=True)  # a new run: its own id
    shutil.rmtree(tmp_path / "ckpt")
    shutil.copytree(tmp_path / "first-ckpt", tmp_path / "ckpt")
    with pytest.raises(train.RunError, match=rf"holds run {first}'s checkpoints, not this run's"):
        train.train(cfg, resume=True)


def test_allow_config_change_needs_resume(tmp_path, capsys):
    with pytest.raises(SystemExit) as code:
        train.main(["--preset", "micro", f"log.dir={tmp_path}", "--allow-config-change"])
    assert code.value.code == 2
    assert capsys.readouterr().err.strip() == "error: --allow-config-change: only with --resume"


def test_a_damaged_whole_digest_is_named_as_such():
    state = {"w": np.ones(3, np.float32), "b": np.zeros(2, np.float32)}
    found = checkpoints.digest(state)
    damaged = {**found, "sha256": "0" * 64}
    with pytest.raises(checkpoints.CheckpointError, match="every leaf matches"):
        raise checkpoints.CheckpointError(checkpoints._digest_mismatch(found, damaged))
    one = {**found, "leaves": [found["leaves"][0], "f" * 64]}
    assert checkpoints._digest_mismatch(found, one) == (
        "1 of 2 leaves differ from their recorded digest (leaves 1)"
    )


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The final state of 3 rounds run straight (checkpointed every round): what every
    stopped-and-resumed run below must end at, bitwise."""
    tmp = tmp_path_factory.mktemp("straight")
    return train.train(_cfg(tmp, "train.rounds=3", "checkpoint.every=1")).state


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_resume_drops_a_torn_last_line(tmp_path, straight):
    train.train(_cfg(tmp_path, "train.rounds=3", "checkpoint.every=1"), stop_after=2)
    metrics = _run_dir(tmp_path) / "metrics.jsonl"
    with metrics.open("a") as f:
        f.write('{"round": 3, "tokens": 1')  # killed while writing round 3's record
    resumed = train.train(_cfg(tmp_path, "train.rounds=3", "checkpoint.every=1"), resume=True)
    assert [r["round"] for r in resumed.history] == [3]
    assert [json.loads(x)["round"] for x in metrics.read_text().splitlines()] == [1, 2, 3]
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _flip_a_bit(step_dir):
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file()]
    biggest = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(biggest.read_bytes())
    data[len(data) // 2] ^= 0x10
    biggest.write_bytes(bytes(data))


# bit_flip in the default suite; the other two damages with -m slow (the same fallback)
@pytest.mark.parametrize(
    "damage",
    [
        "bit_flip",
        *(pytest.param(d, marks=pytest.mark.slow) for d in ("missing_state", "torn_digest")),
    ],
)
@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(
    damage, tmp_path, capsys, straight
):
    common = ["train.rounds=3", "checkpoint.every=1", "checkpoint.keep=3"]
    train.train(_cfg(tmp_path, *common), stop_after=2)
    newest = tmp_path / "ckpt" / "2"
    if damage == "bit_flip":
        _flip_a_bit(newest)
    elif damage == "missing_state":
        for p in sorted((newest / "state").rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
    else:
        (newest / "digest" / "metadata").write_text('{"sha256": "ab')
    capsys.readouterr()
    resumed = train.train(_cfg(tmp_path, *common), resume=True)
    err = capsys.readouterr().err
    assert "warning: checkpoint step 2 is unusable" in err and "restoring step 1" in err
    assert [r["round"] for r in resumed.history] == [2, 3]
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_digest_sees_one_flipped_bit():
    a = {"w": np.arange(6, dtype=np.float32)}
    b = {"w": a["w"].copy()}
    b["w"].view(np.uint32)[3] ^= 1
    assert checkpoints.digest(a)["sha256"] != checkpoints.digest(b)["sha256"]
    assert checkpoints.digest(a) == checkpoints.digest({"w": a["w"].copy()})


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.cases("each")
def test_a_signal_stops_at_the_round_boundary_with_a_checkpoint(signum, tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, "train.rounds=4", "checkpoint.every=10")
    real = train.build_validated  # the run's build, after its one validation
    calls_of = []

    def build(cfg):
        run = real(cfg)
        step = run.trainer.round
        calls = []

        def round_(state, batch):
            calls.append(1)
            if len(calls) == 2:  # the signal arrives while round 2 computes
                os.kill(os.getpid(), signum)
            return step(state, batch)

        if not calls_of:  # the first build's trainer (a shared one is built once)
            run.trainer.round = round_
            calls_of.append(run.trainer)
        return run

    monkeypatch.setattr(train, "build_validated", build)
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    from experiments import programs

    with programs.shared_programs():  # the resumed run's round compiled once
        with pytest.raises(train.Interrupted) as caught:
            train.train(cfg)
        assert caught.value.rounds == 2 and caught.value.saved == 2
        assert checkpoints.Checkpoints(tmp_path / "ckpt", 2).steps() == [2]
        # restored to what they were (SIG_IGN for SIGINT in a shell's background job)
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
        monkeypatch.setattr(train, "build_validated", real)
        resumed = train.train(cfg, resume=True)
    assert [r["round"] for r in resumed.history] == [3, 4]


@pytest.mark.parametrize("resumed", [False, True], ids=["fresh", "resumed"])
@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_a_signal_during_start_up_prints_what_to_do(resumed, tmp_path, monkeypatch, capsys):
    """A SIGTERM while the command loads its config (before any round): before, the run
    ended with Python's default handler and no word; now the handlers are installed on the
    command's first line, and it stops before training, saying what to run."""
    logs, ckpt = f"log.dir={tmp_path / 'logs'}", f"checkpoint.dir={tmp_path / 'ckpt'}"
    args = ["--preset", "micro", logs, ckpt, "log.tensorboard=false", "train.rounds=3"]
    args.append("checkpoint.every=1")
    if resumed:
        train.train(_cfg(tmp_path, "train.rounds=3", "checkpoint.every=1"), stop_after=1)
    real = train.checks.load

    def load(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives during start-up
        return real(*a, **k)

    monkeypatch.setattr(train.checks, "load", load)
    with pytest.raises(SystemExit) as code:
        train.main([*args, "--resume"] if resumed else args)
    assert code.value.code == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    if resumed:
        assert "SIGTERM: stopped after round 1 (checkpoint at round 1); resume with:" in err
        assert "--resume" in err.splitlines()[-1]
    else:
        assert "SIGTERM: stopped after round 0 (no checkpoint); nothing was trained" in err
    monkeypatch.setattr(train.checks, "load", real)
    train.main([*args, "--resume"] if resumed else [*args, "--overwrite"])  # then it runs


class _Killed(BaseException):
    """The process dying at a write point (not an Exception: nothing may catch it)."""


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_a_kill_at_every_write_point_loses_and_duplicates_nothing(tmp_path, monkeypatch):
    """Every file the run directory gets (config.json, run.json, the rewritten metrics) goes
    through one atomic writer; the process is killed at each of its write points in turn
    (after the temporary file is written, before the rename), and the next --resume ends
    with every round's record once, equal to an uninterrupted run's."""
    cfg = _cfg(tmp_path, "train.rounds=4", "checkpoint.every=1")
    straight = _cfg(tmp_path / "straight", "train.rounds=4", "checkpoint.every=1")
    want = [r["round"] for r in train.train(straight).history]
    train.train(cfg, stop_after=1)
    real = files_lib.replace_synced
    points = 0
    for n in range(1, 10):
        calls = []

        def dying(tmp, path, n=n, calls=calls):
            calls.append(path.name)
            if len(calls) == n:
                raise _Killed(path.name)
            real(tmp, path)

        monkeypatch.setattr(files_lib, "replace_synced", dying)
        try:
            train.train(cfg, resume=True, stop_after=1 + n)
        except _Killed:
            points += 1
        monkeypatch.setattr(files_lib, "replace_synced", real)
        if len(calls) < n:  # no n-th write point in a resumed run's start: all were covered
            break
    assert points >= 3  # config.json, run.json, metrics.jsonl
    train.train(cfg, resume=True)
    records = [
        json.loads(line) for line in (_run_dir(tmp_path) / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["round"] for r in records] == want == [1, 2, 3, 4]
    assert json.loads((_run_dir(tmp_path) / "config.json").read_text())["name"] == "micro"


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_a_diverged_run_stops_with_an_error(tmp_path):
    with pytest.raises(train.Diverged, match="training loss is nan on every replica"):
        train.train(_cfg(tmp_path, "inner.learning_rate=1e30", "train.rounds=3", ckpt=False))


def _tensorboard_view(directory):
    """What TensorBoard shows of a run's event files, read in order: each scalar tag's
    (step, value) points, after every ``SessionLog.START`` at step s (a writer opened with
    ``purge_step=s``) has hidden the points logged before it at steps >= s; and the
    hyperparameter plugin's summaries seen."""
    from tensorboardX.proto import event_pb2

    points, plugins = {}, []
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            n = int.from_bytes(data[at : at + 8], "little")
            event = event_pb2.Event.FromString(data[at + 12 : at + 12 + n])
            at += 12 + n + 4
            if event.HasField("session_log") and event.session_log.status == 1:  # START
                for tag in points:
                    points[tag] = [(s, v) for s, v in points[tag] if s < event.step]
            for v in event.summary.value:
                if v.metadata.plugin_data.plugin_name == "hparams":
                    plugins.append(v.tag)
                else:
                    points.setdefault(v.tag, []).append((event.step, v.simple_value))
    return points, plugins


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_tensorboard_shows_each_round_once_after_resume(tmp_path):
    pytest.importorskip("tensorboardX")
    common = ["train.rounds=3", "checkpoint.every=1", "log.tensorboard=true"]
    train.train(_cfg(tmp_path, *common), stop_after=2)
    # the next run resumes from round 1: what round 2 logged first must be hidden
    import shutil

    shutil.rmtree(tmp_path / "ckpt" / "2")
    resumed = train.train(_cfg(tmp_path, *common), resume=True)
    points, plugins = _tensorboard_view(_run_dir(tmp_path) / "tensorboard")
    assert [s for s, _ in points["train_loss"]] == [1, 2, 3]  # step: the round
    records = [json.loads(x) for x in (_run_dir(tmp_path) / "metrics.jsonl").open()]
    assert [v for _, v in points["train_loss"]] == pytest.approx(
        [r["train_loss"] for r in records], rel=1e-6
    )
    assert [v for _, v in points["train_loss"]][1] == pytest.approx(
        resumed.history[0]["train_loss"], rel=1e-6
    )  # round 2 as the resumed run logged it
    by_tokens, _ = _tensorboard_view(_run_dir(tmp_path) / "tensorboard" / "by_tokens")
    tokens = [r["tokens"] for r in records]
    assert [s for s, _ in by_tokens["by_tokens/train_loss"]] == tokens  # the second axis
    assert all(len({s for s, _ in p}) == len(p) for p in points.values())
    # the config as hyperparameters, written once by the first run; the session ended once
    assert plugins.count("_hparams_/experiment") == 1
    assert plugins.count("_hparams_/session_start_info") == 1
    assert plugins.count("_hparams_/session_end_info") == 1


def test_the_config_is_the_runs_hyperparameters(tmp_path):
    hp = rundir.hparams(_cfg(tmp_path, "outer.algorithm=co2"))
    assert hp["outer.algorithm"] == "co2" and hp["train.rounds"] == 2
    assert hp["checkpoint.dir"] == str(tmp_path / "ckpt") and hp["data.path"] == "none"
    assert all(isinstance(v, bool | int | float | str) for v in hp.values())


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_resuming_a_finished_run_says_so(tmp_path, capsys):
    args = [
        "--preset", "micro", f"log.dir={tmp_path / 'logs'}", "log.tensorboard=false",
        f"checkpoint.dir={tmp_path / 'ckpt'}", "train.rounds=1",
    ]  # fmt: skip
    train.main(args)
    capsys.readouterr()
    train.main(["--resume", *args])
    assert "micro: already finished (1 rounds); nothing to run" in capsys.readouterr().out


def _tensorboard_matches_metrics(run_dir):
    """TensorBoard's scalars equal metrics.jsonl, round by round: every numeric field of every
    record once at its round (and the losses once at its tokens), nothing else."""
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").open()]
    points, _ = _tensorboard_view(run_dir / "tensorboard")
    by_tokens, _ = _tensorboard_view(run_dir / "tensorboard" / "by_tokens")
    want = {}
    for r in records:
        for key, value in r.items():
            if isinstance(value, int | float) and key != "round":
                want.setdefault(key, []).append((r["round"], float(value)))
    assert set(points) == set(want), sorted(set(points) ^ set(want))
    for key, series in want.items():
        assert sorted(s for s, _ in points[key]) == [s for s, _ in series], key
        got = dict(points[key])
        assert [got[s] for s, _ in series] == pytest.approx([v for _, v in series], rel=1e-6)
    tokens = sorted(by_tokens["by_tokens/train_loss"])
    assert [s for s, _ in tokens] == [r["tokens"] for r in records]
    assert [v for _, v in tokens] == pytest.approx([r["train_loss"] for r in records], rel=1e-6)
    return records


def test_tensorboard_holds_every_record_whatever_the_killed_run_flushed(tmp_path):
    """Before: after a kill and --resume, TensorBoard lacked the rounds whose events the killed
    process had not flushed (tensorboardX buffers them), though metrics.jsonl held them. Now a
    resumed run writes its event files anew from metrics.jsonl: here the killed run flushed
    nothing at all (its event files gone), and every round is back, once."""
    pytest.importorskip("tensorboardX")
    import shutil

    from experiments import programs

    cfg = _cfg(tmp_path, "train.rounds=3", "checkpoint.every=1", "log.tensorboard=true")
    with programs.shared_programs():  # the resumed run's round compiled once
        train.train(cfg, stop_after=2)
        tensorboard = _run_dir(tmp_path) / "tensorboard"
        for path in tensorboard.rglob("events.out.tfevents.*"):
            path.unlink()
        shutil.rmtree(tmp_path / "ckpt" / "2")  # and the resume repeats a round
        train.train(cfg, resume=True)
    records = _tensorboard_matches_metrics(_run_dir(tmp_path))
    assert [r["round"] for r in records] == [1, 2, 3]
    _, plugins = _tensorboard_view(tensorboard)
    assert plugins.count("_hparams_/session_start_info") == 1
    assert plugins.count("_hparams_/session_end_info") == 1


@pytest.mark.slow  # two processes and a resume (about 40 s); the in-process twin runs by default
@pytest.mark.parametrize("seed", [0, 1])
def test_sigkill_then_resume_keeps_tensorboard_equal_to_metrics(seed, tmp_path):
    """The training command killed with SIGKILL at a random moment after its second record,
    then resumed: TensorBoard's scalars equal metrics.jsonl round by round."""
    pytest.importorskip("tensorboardX")
    import random
    import subprocess
    import sys
    import time
    from pathlib import Path

    args = [
        "--preset", "micro", f"log.dir={tmp_path / 'logs'}", f"checkpoint.dir={tmp_path / 'ckpt'}",
        "train.rounds=8", "checkpoint.every=3", "log.tensorboard=true",
    ]  # fmt: skip
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-m", "experiments.train", *args], cwd=root)
    metrics = _run_dir(tmp_path) / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.05)
    time.sleep(random.Random(seed).uniform(0.0, 1.5))
    proc.kill()
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before the kill"
    train.main([*args, "--resume"])
    records = _tensorboard_matches_metrics(_run_dir(tmp_path))
    assert [r["round"] for r in records] == list(range(1, 9))
