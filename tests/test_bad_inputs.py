"""Bad input raises a clear error naming the argument and the value, before any compute."""

from __future__ import annotations

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
    cfg = _run_cfg(tmp_path, f"checkpoint.dir={tmp_path / 'ckpt'}", "train.rounds=1")
    history = train.train(cfg, resume=True).history
    assert [r["round"] for r in history] == [1]
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
        tmp_path, f"checkpoint.dir={tmp_path / 'ckpt'}", "train.rounds=3", "checkpoint.every=1"
    )
    train.train(cfg, stop_after=2)
    capsys.readouterr()
    assert [r["round"] for r in train.train(cfg, resume=True).history] == [3]
    assert f"resumed from round 2 of 3 (checkpoint.dir={tmp_path / 'ckpt'})" in (
        capsys.readouterr().err
    )


def test_a_run_that_fails_before_its_first_round_leaves_nothing_behind(tmp_path, monkeypatch):
    """Before: a run that failed after validation (a compile error in its first round, say)
    left config.json, run.json and an empty metrics.jsonl, and the same command was then
    refused ('already holds a run'). Now the run directory goes with the failure, and the
    command runs again as it is."""
    from experiments import train

    real = train.build_validated

    def failing(cfg):
        run = real(cfg)

        def round_(state, batch):
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory while compiling")

        run.trainer.round = round_
        return run

    cfg = _run_cfg(tmp_path, f"checkpoint.dir={tmp_path / 'ckpt'}", "train.rounds=1")
    monkeypatch.setattr(train, "build_validated", failing)
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        train.train(cfg)
    assert not (tmp_path / "logs" / "micro").exists()
    monkeypatch.setattr(train, "build_validated", real)
    assert [r["round"] for r in train.train(cfg).history] == [1]  # no --overwrite needed


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
