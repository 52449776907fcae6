"""The experiments: configs, the training driver on the emulated mesh, exact resume, report."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from co2jax.algorithms import registry
from experiments import checks, compare, programs, report, sweep_rows, train
from experiments import config as config_lib
from experiments import inner as inner_lib
from experiments import model as model_lib

CPU_PRESETS = ["cpu-tiny", "cpu-stdlib", "micro"]


def _micro(tmp_path, *overrides):
    cfg = config_lib.override(
        config_lib.preset("micro"), [f"log.dir={tmp_path}", "log.tensorboard=false", *overrides]
    )
    return cfg


@pytest.mark.parametrize("name", sorted(config_lib.PRESETS))
def test_every_preset_parses_validates_and_round_trips(name):
    cfg = config_lib.preset(name)
    if cfg.data.kind == "tokens":
        with pytest.raises(ValueError, match=r"data\.path=None"):  # the launch scripts give it
            checks.validate(cfg)
        cfg = config_lib.override(cfg, ["data.path=/data/tokens.bin"])
    checks.validate(cfg, 8 if name in CPU_PRESETS else None)
    assert config_lib.from_dict(config_lib.to_dict(cfg)) == cfg
    mcfg = model_lib.preset(cfg.model.preset)
    assert model_lib.param_count(mcfg) > 0


@pytest.mark.parametrize("name", ["cpu-tiny", "cpu-stdlib"])
def test_cpu_presets_build(name):
    run = programs.build(config_lib.preset(name))
    assert run.trainer.replicas == 4 and run.streams.shape[:2] == (4, run.cfg.train.sync_every)


def test_overrides():
    cfg = config_lib.override(
        config_lib.preset("cpu-tiny"),
        ["outer.algorithm=co2", "outer.clip_threshold=0.5", "data.iid=false", "name=x"],
    )
    assert (cfg.outer.algorithm, cfg.outer.clip_threshold, cfg.data.iid, cfg.name) == (
        "co2",
        0.5,
        False,
        "x",
    )
    assert config_lib.override(cfg, ["outer.clip_threshold=none"]).outer.clip_threshold is None
    with pytest.raises(ValueError, match=r"^outer\.lr: co2 has no such setting"):
        config_lib.override(cfg, ["outer.lr=1"])
    with pytest.raises(ValueError, match=r"outer\.momentum='fast'"):
        config_lib.override(cfg, ["outer.momentum=fast"])
    with pytest.raises(ValueError, match=r"section\.field=value"):
        config_lib.override(cfg, ["outer.momentum"])


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["outer.algorithm=adam"], "outer.algorithm='adam'"),
        (["train.sync_every=0"], "train.sync_every=0"),
        (["mesh.replica=3"], "mesh.replica=3"),
        (["data.batch=5"], "data.batch=5"),
        (["data.kind=text"], "data.path=None"),
        (["outer.algorithm=co2", "outer.penalty=big"], "outer.penalty='big'"),
        (["outer.penalty=constant"], "outer.penalty: diloco has no such setting"),
        (["outer.momentum=1.0"], "outer.momentum=1.0"),
        (["outer.implementation=cuda"], "outer.implementation='cuda'"),
    ],
)
def test_bad_configs_fail_before_compiling(overrides, match, tmp_path):
    with pytest.raises(ValueError, match=match.replace("(", r"\(")):
        programs.build(_micro(tmp_path, *overrides))  # refused by the override or by build


# The default suite drives one algorithm of most kinds the driver treats apart (synchronous,
# delayed, fragments, compressed with error feedback, gossip, a per-step inner transform);
# the rest, eager updates and DDP included, run with -m slow (each is checked in every
# engine by test_matrix.py either way).
_DRIVER_KINDS = {"diloco", "co2", "streaming_diloco", "sparseloco", "noloco", "demo"}


@pytest.mark.parametrize(
    "algorithm",
    [
        a if a in _DRIVER_KINDS else pytest.param(a, marks=pytest.mark.slow)
        for a in config_lib.ALGORITHMS
    ],
)
@pytest.mark.cases("algorithms", 19)
def test_every_algorithm_runs_two_rounds(algorithm, tmp_path):
    momentum = "0.0" if algorithm in ("co2", "delayed_diloco", "eager_diloco") else "0.9"
    has = {f.name for f in dataclasses.fields(registry.REGISTRY[algorithm])}
    extra = [f"outer.momentum={momentum}"] if "momentum" in has else []
    extra += ["outer.tau=0"] if registry.capabilities(algorithm).fragments else []  # H 2, P 2
    cfg = _micro(tmp_path, f"outer.algorithm={algorithm}", *extra)
    result = train.train(cfg)
    assert [r["round"] for r in result.history] == [1, 2]
    last = result.history[-1]
    assert np.isfinite(last["eval_loss"]) and np.isfinite(last["train_loss"])
    assert last["bytes_total"] > 0
    lines = (tmp_path / "micro" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    assert (tmp_path / "micro" / "config.json").exists()


@pytest.mark.parametrize(
    "algorithm, programs_of",
    [("diloco", "each_run"), ("co2", "each_run"), ("co2", "shared")],
    ids=["diloco", "co2", "co2-shared_programs"],
)
@pytest.mark.cases(rule=lambda algorithm, programs_of: programs_of == "shared")
def test_resume_is_bitwise_identical(algorithm, programs_of, tmp_path):
    """4 rounds straight == 2 rounds, stop, resume for 2 more (delayed CO2 included).

    Checkpoints are taken at round boundaries, so a kill anywhere inside round 3 resumes the
    same way: from the round-2 checkpoint, repeating round 3. ``each_run``: every run
    compiles its own programs, as separate processes do; ``shared``: the three runs share one
    compiled round (``programs.shared_programs``), the state restored into it.
    """
    with programs.shared_programs() if programs_of == "shared" else contextlib.nullcontext():
        _resume_is_bitwise_identical(algorithm, tmp_path)


def _resume_is_bitwise_identical(algorithm, tmp_path):
    common = [f"outer.algorithm={algorithm}", "train.rounds=4", "checkpoint.every=1"]
    if algorithm == "co2":
        common += ["outer.momentum=0.5", "outer.penalty=gap_aware", "outer.clip_threshold=0.05"]
    straight = train.train(
        _micro(tmp_path / "a", *common, f"checkpoint.dir={tmp_path / 'ca'}")
    ).state
    cfg = _micro(tmp_path / "b", *common, f"checkpoint.dir={tmp_path / 'cb'}")
    first = train.train(cfg, stop_after=2)
    assert [r["round"] for r in first.history] == [1, 2]
    # a kill during the save of round 3 leaves orbax's temporary directory behind: ignored
    partial = tmp_path / "cb" / "3.orbax-checkpoint-tmp-1796000000000000"
    partial.mkdir()
    (partial / "junk").write_text("half-written")
    resumed = train.train(cfg, resume=True)
    assert [r["round"] for r in resumed.history] == [3, 4]
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    records = (tmp_path / "b" / "micro" / "metrics.jsonl").read_text().splitlines()
    assert len(records) == 4


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_report_writes_table_and_plots(tmp_path, monkeypatch):
    import tqdm

    bars = []

    class Bar(tqdm.tqdm):  # each row's bar of its rounds, recorded
        def __init__(self, *args, **kwargs):
            bars.append(kwargs)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(tqdm, "tqdm", Bar)
    base = _micro(tmp_path / "runs", "log.progress=false")
    sweep = [("DDP", ["outer.algorithm=ddp"]), ("CO2", ["outer.algorithm=co2"])]
    link = sweep_rows.Link()
    rows = compare.run_sweep(base, tmp_path, link, sweep)
    assert [(b["desc"], b["total"], b["leave"], b["disable"]) for b in bars] == [
        ("DDP", 2, False, None),  # None: shown on a terminal only
        ("CO2", 2, False, None),
    ]
    path = report.write_report(rows, base, tmp_path, link)
    text = path.read_text()
    assert "| DDP |" in text and "| CO2 |" in text and "Published ordering" in text
    assert "tokens/s (measured, CPU-emulated)" in text and "8 CPU-emulated devices" in text
    claim = next(ln for ln in text.splitlines() if ln.startswith("- CO2 reaches"))
    assert ("**held**" in claim or "**not held**" in claim) and "DDP " in claim
    for name in ("loss_vs_tokens.png", "loss_vs_bytes.png", "loss_vs_wallclock.png"):
        assert (tmp_path / name).stat().st_size > 1000


def _claim_rows(**losses):
    rows = [
        {"label": label, "status": "done", "eval_loss": loss, "flag": None}
        for label, loss in losses.items()
    ]
    return {r["label"]: r for r in rows}


def test_each_published_claim_is_held_or_not_with_its_numbers():
    rows = _claim_rows(
        **{"DDP": 2.00, "DiLoCo": 2.015, "Eager DiLoCo": 2.03, "Delayed DiLoCo (naive)": 2.5}
    )
    lines = {ln.split(":")[0][2:]: ln for ln in report.verdicts(list(rows.values()))}
    eager = lines[next(k for k in lines if k.startswith("Eager updates"))]
    # 2.03 is within 1% of DiLoCo's 2.015 and below the naive delay's 2.5
    assert "**held**" in eager and "Eager DiLoCo 2.0300" in eager
    assert "**held**" in lines["DiLoCo matches fully synchronous training (arXiv 2311.08105)"]
    assert "not in this sweep (CO2 not run)" in lines[next(k for k in lines if "CO2" in k)]
    rows["Eager DiLoCo"]["eval_loss"] = 2.06  # 2.2% above DiLoCo: not a match
    rows["DiLoCo"]["eval_loss"] = 2.03  # 1.5% above DDP
    lines = report.verdicts(list(rows.values()))
    assert "**not held**" in next(ln for ln in lines if ln.startswith("- Eager updates"))
    assert "**not held**" in next(ln for ln in lines if ln.startswith("- DiLoCo matches"))
    rows["Eager DiLoCo"]["eval_loss"] = 2.03
    rows["Delayed DiLoCo (naive)"]["flag"] = "diverged"  # worse than any finite loss
    line = next(ln for ln in report.verdicts(list(rows.values())) if "Eager" in ln)
    assert "**held**" in line and "Delayed DiLoCo (naive) diverged" in line, line
    rows["Eager DiLoCo"]["flag"] = "diverged"  # on the winning side: the order fails
    line = next(ln for ln in report.verdicts(list(rows.values())) if "Eager" in ln)
    assert "**not held**" in line and "Eager DiLoCo diverged" in line, line
    for r in rows.values():
        r["flag"] = "diverged"
    line = next(ln for ln in report.verdicts(list(rows.values())) if "Eager" in ln)
    assert "cannot be judged" in line, line
    rows["DDP"]["status"] = "failed"
    line = next(ln for ln in report.verdicts(list(rows.values())) if "DiLoCo matches" in ln)
    assert "cannot be judged (DDP failed)" in line, line


def test_rows_fall_into_their_family_facets():
    row = lambda a, *o: {"algorithm": a, "overrides": [f"outer.algorithm={a}", *o]}
    assert report.family(row("ddp")) == report.family(row("diloco")) == "synchronous and periodic"
    assert report.family(row("co2")) == report.family(row("eager_diloco")) == "delayed and eager"
    assert report.family(row("streaming_diloco")) == "streaming"
    compressed = "compressed, sparse and gossip"
    assert report.family(row("diloco", "outer.compression=int8")) == compressed
    assert report.family(row("diloco", "outer.compression=none")) != compressed
    assert report.family(row("sparseloco")) == compressed
    assert report.family({"algorithm": "new_one"}) == "new_one"  # a facet of its own
    covered = {a for _, algorithms in report.FAMILIES for a in algorithms}
    assert covered == set(config_lib.ALGORITHMS)  # every registered algorithm has a family


def test_a_diverged_row_is_not_priced(tmp_path):
    base = _micro(tmp_path / "runs", "log.progress=false")
    row = {
        "label": "Bad", "algorithm": "diloco", "status": "done", "eval_loss": 9.0,
        "eval_std": None, "excess": None, "bytes_total": 1e6, "tokens_per_s": 123.0,
        "sim_s": 4.5, "flag": "diverged", "ran": True, "tokens": 10, "entropy": None,
        "config": "c.json", "hash": "h", "curve_tokens": [10], "curve_loss": [9.0],
        "curve_bytes": [1e6], "curve_sim_s": [4.5],
    }  # fmt: skip
    text = report.write_report([row], base, tmp_path, sweep_rows.Link()).read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("| Bad |"))
    assert "| — | — | — |" in line and "123" not in line and "4.5" not in line, line


@pytest.mark.slow
def test_report_with_seed_spread(tmp_path):
    base = _micro(tmp_path / "runs", "log.progress=false")
    link = sweep_rows.Link()
    rows = compare.run_sweep(base, tmp_path, link, [("DiLoCo", ["outer.algorithm=diloco"])], 2)
    (row,) = rows
    assert len(row["seed_losses"]) == 2 and row["seed_losses"][0] != row["seed_losses"][1]
    assert row["eval_loss"] == pytest.approx(np.mean(row["seed_losses"]))
    assert row["eval_std"] > 0
    text = report.write_report(rows, base, tmp_path, link).read_text()
    assert "±" in text and "over 2 seeds" in text


def test_cost_model():
    link = sweep_rows.Link(bandwidth_gbps=1.0, latency_ms=0.0, overlap_slowdown=0.0)
    comm = link.allreduce_s(1e9 / 8, 2)  # 1 Gbit payload, 2 replicas: 1 s
    assert comm == pytest.approx(1.0)
    assert sweep_rows.simulated_round_s("diloco", 0.1, 10, 1e9 / 8, 2, link) == pytest.approx(2.0)
    # an overlapped reduction hides behind the round's 1 s of compute
    assert sweep_rows.simulated_round_s("co2", 0.1, 10, 1e9 / 8, 2, link) == pytest.approx(1.0)
    assert sweep_rows.simulated_round_s("co2", 0.05, 10, 1e9 / 8, 2, link) == pytest.approx(1.0)
    assert sweep_rows.simulated_round_s("ddp", 0.1, 10, 1e9 / 8, 2, link) == pytest.approx(11.0)
    # SPARTA-DiLoCo: a 0.1 s exchange after each of the 10 steps, the 1 s round all-reduce
    sparta = sweep_rows.simulated_round_s("sparta_diloco", 0.1, 10, 1e9 / 8, 2, link, 1, 0,
                                          step_payload_bytes=1e8 / 8)  # fmt: skip
    assert sparta == pytest.approx(1.0 + 10 * 0.1 + 1.0)
    slow = dataclasses.replace(link, overlap_slowdown=0.2)
    assert sweep_rows.simulated_round_s("co2", 0.1, 10, 1e9 / 8, 2, slow) == pytest.approx(1.2)
    # the documented path (benchmarks, docs/performance.md): experiments.compare's names
    assert compare.Link is sweep_rows.Link
    assert compare.simulated_round_s is sweep_rows.simulated_round_s


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_tensorboard_and_progress(tmp_path, capsys):
    cfg = _micro(
        tmp_path,
        "log.tensorboard=true",
        "log.progress=true",
        "outer.algorithm=co2",
        "outer.clip_threshold=1e-9",  # every nonzero momentum element sits at the bound
    )
    train.train(cfg)
    events = list((tmp_path / "micro" / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    record = (tmp_path / "micro" / "metrics.jsonl").read_text().splitlines()[-1]
    for key in ("penalty_scale", "cosine_to_mean", "inner_lr", "skipped", "collective"):
        assert key in record
    assert json.loads(record)["clip_fraction"] > 0.9  # round 2 applies the first average
    # the logged inner lr (a table evaluated once) is the schedule at each round's end
    schedule = programs.build(cfg).schedule
    H = cfg.train.sync_every
    for line in (tmp_path / "micro" / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        assert rec["inner_lr"] == pytest.approx(float(schedule(rec["round"] * H)), rel=1e-6)
    assert "micro" in capsys.readouterr().err  # the tqdm bar


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_consensus_distance_is_recorded_with_each_eval(tmp_path):
    import co2jax

    # NoLoCo's replicas differ by design: a nonzero distance, on eval rounds only
    cfg = _micro(tmp_path, "outer.algorithm=noloco", "train.rounds=3", "eval.every=2")
    result = train.train(cfg)
    lines = (tmp_path / "micro" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(x) for x in lines]
    assert [("consensus_distance" in r, "eval_loss" in r) for r in records] == [
        (False, False),
        (True, True),
        (True, True),  # the last round
    ]
    expected = float(co2jax.consensus_distance(result.state.params))
    assert records[-1]["consensus_distance"] == pytest.approx(expected) and expected > 0


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_shared_programs_run_each_seed_as_a_build_of_its_own(tmp_path):
    """Inside ``shared_programs`` the seeds of one config share a trainer (one compiled
    round), and the second seed's records equal those of a run built on its own; another
    config (a different H) gets a trainer of its own, and outside it nothing is shared."""
    configs = {
        name: _micro(tmp_path / name, *extra, f"name={name}")
        for name, extra in (("s0", []), ("s1", ["train.seed=1"]), ("h", ["train.sync_every=3"]))
    }
    with programs.shared_programs():
        trainers = {name: programs.build(cfg).trainer for name, cfg in configs.items()}
        shared = {name: train.train(cfg).history for name, cfg in configs.items()}
        assert programs.build(configs["s1"]).trainer is trainers["s0"]
    assert trainers["s0"] is trainers["s1"] and trainers["h"] is not trainers["s0"]
    assert programs.build(configs["s0"]).trainer is not programs.build(configs["s1"]).trainer
    alone = train.train(configs["s1"], overwrite=True).history
    assert shared["s0"][-1]["eval_loss"] != shared["s1"][-1]["eval_loss"]  # the seed
    drop = ("seconds", "tokens_per_s")
    for a, b in zip(shared["s1"], alone, strict=True):
        assert {k: v for k, v in a.items() if k not in drop} == {
            k: v for k, v in b.items() if k not in drop
        }


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_shared_programs_share_a_round_across_outer_lrs_held_in_the_state(tmp_path):
    """With ``outer.lr_in_state``, runs that differ only in a constant outer lr share one
    trainer, and each trains at its own lr: its records equal a run built on its own. A
    warmed-up lr is computed in the program: no sharing there."""
    common = ["outer.algorithm=diloco", "outer.lr_in_state=true", "train.rounds=2"]
    configs = {
        name: _micro(tmp_path / name, *common, *extra, f"name={name}")
        for name, extra in (
            ("a", ["outer.learning_rate=0.3"]),
            ("b", ["outer.learning_rate=0.9"]),
            ("warm", ["outer.learning_rate=0.9", "outer.lr_warmup=2"]),
        )
    }
    with programs.shared_programs():
        trainers = {name: programs.build(cfg).trainer for name, cfg in configs.items()}
        shared = {name: train.train(cfg).history for name in ("a", "b") for cfg in [configs[name]]}
    assert trainers["a"] is trainers["b"]
    assert trainers["warm"] is not trainers["b"]
    alone = train.train(configs["b"], overwrite=True).history
    assert shared["a"][-1]["eval_loss"] != shared["b"][-1]["eval_loss"]  # the lr matters
    drop = ("seconds", "tokens_per_s")
    for a, b in zip(shared["b"], alone, strict=True):
        assert {k: v for k, v in a.items() if k not in drop} == {
            k: v for k, v in b.items() if k not in drop
        }


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_the_driver_trains_round_k_on_the_streams_batch_k(tmp_path):
    """The driver draws round k + 1's tokens while round k computes: its losses are those of
    a plain loop over ``streams.round_batch(k)``."""
    cfg = _micro(tmp_path, "train.rounds=3", "eval.every=0")
    with programs.shared_programs():
        history = train.train(cfg).history
        run = programs.build(cfg)
        state = run.trainer.init(run.params)
        for k, record in enumerate(history):
            state, metrics = run.trainer.round(state, run.streams.round_batch(k))
            assert record["train_loss"] == float(np.asarray(metrics.loss).mean())


def test_config_implementations_are_the_kernels():
    import co2jax

    assert config_lib.CHOICES["outer.implementation"] == co2jax.kernels.IMPLEMENTATIONS


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_fused_kernel_in_the_driver_equals_xla(tmp_path):
    """CO2 with the gap-aware penalty: the kernel (interpreter) and XLA give the same run."""
    common = ["outer.algorithm=co2", "outer.penalty=gap_aware", "outer.clip_threshold=0.05"]
    xla = train.train(_micro(tmp_path / "x", *common, "outer.implementation=xla"))
    fused = train.train(_micro(tmp_path / "p", *common, "outer.implementation=interpret"))
    for a, b in zip(xla.history, fused.history, strict=True):
        np.testing.assert_allclose(a["eval_loss"], b["eval_loss"], rtol=1e-5)


def test_streaming_simulation_hides_each_fragment_behind_tau_steps():
    link = sweep_rows.Link(bandwidth_gbps=1.0, latency_ms=0.0, overlap_slowdown=0.0)
    # 2 fragments of 0.5 Gbit each (0.5 s per ring all-reduce at R=2), 10 steps of 0.1 s:
    # tau = 4 (the most 2 fragments of H = 10 allow) hides 0.4 s of each
    full = sweep_rows.simulated_round_s("streaming_diloco", 0.1, 10, 1e9 / 8, 2, link, 2, 0)
    hidden = sweep_rows.simulated_round_s("streaming_diloco", 0.1, 10, 1e9 / 8, 2, link, 2, 4)
    assert full == pytest.approx(2.0) and hidden == pytest.approx(1.2)


@pytest.fixture(scope="module")
def plain_diloco(tmp_path_factory):
    return train.train(_micro(tmp_path_factory.mktemp("plain"), "outer.algorithm=diloco"))


@pytest.mark.parametrize(
    "overrides",
    [
        ["outer.algorithm=streaming_diloco", "outer.tau=0", "outer.compression=fp4"],
        ["outer.algorithm=diloco", "outer.compression=int8", "outer.error_feedback=true"],
        ["outer.algorithm=sparseloco", "outer.topk=64"],
    ],
    ids=["streaming_fp4", "diloco_int8_ef", "sparseloco"],
)
@pytest.mark.cases("first", 1)
def test_compressed_algorithms_run_and_send_fewer_bytes(overrides, plain_diloco, tmp_path):
    plain = plain_diloco
    result = train.train(_micro(tmp_path / "c", *overrides))
    last = result.history[-1]
    assert np.isfinite(last["eval_loss"])
    # an all-gather sends R-1 encoded copies against a ring all-reduce's 2(R-1)/R float32
    # payloads: int8 at R = 4 is ~1.9x fewer bytes, FP4 ~3.9x, SparseLoCo far fewer
    assert last["bytes_total"] < plain.history[-1]["bytes_total"] / 1.5


@pytest.mark.parametrize(
    "layout", [["mesh.data=1", "mesh.model=2"], ["train.fsdp=true"]], ids=["tp", "fsdp"]
)
@pytest.mark.cases("first", 1)
def test_tensor_parallel_and_fsdp_halve_the_parameters_and_keep_the_loss(layout):
    """mesh.model=2 splits the transformer over model by its declared logical axes (heads,
    MLP units, vocabulary), train.fsdp=true over data: per-device parameter bytes (the placed
    state, and the compiled round's argument bytes) fall to about half, and the first round's
    losses equal the whole-parameter run's (4 replicas x 2 data devices x 1) within 1e-5."""
    from co2jax.engines.layout import nbytes_per_device

    def first_round(overrides):
        cfg = config_lib.override(
            config_lib.preset("cpu-tiny"),
            ["mesh.replica=4", "mesh.data=2", "mesh.model=1", "train.sync_every=2", *overrides],
        )
        run = programs.build(cfg)
        state = run.trainer.init(run.params)
        batch = run.streams.round_batch(0)
        placed = run.trainer.place_batch(batch)
        compiled = run.trainer.lower(state, placed).compile()
        bytes_in = compiled.memory_analysis().argument_size_in_bytes
        state, metrics = compiled(state, placed)  # the round, run by the program measured
        return nbytes_per_device(state.params), bytes_in, np.asarray(metrics.loss)

    whole, whole_in, want = first_round([])
    split, split_in, got = first_round(layout)
    assert 0.48 < split / whole < 0.51 and split_in < 0.6 * whole_in, (split, whole)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_mesh_model_must_divide_what_tensor_parallelism_splits():
    cfg = config_lib.override(
        config_lib.preset("cpu-tiny"), ["mesh.replica=1", "mesh.data=1", "mesh.model=8"]
    )
    with pytest.raises(ValueError, match=r"mesh\.model=8: must divide .*n_heads=4"):
        programs.build(cfg)


def test_the_gpu_flags_exist_in_this_jaxlib():
    """XLA refuses an unknown flag when its backend starts: the flags the experiments set
    start one (any backend parses every xla_gpu_* flag), and an unknown one does not."""
    from experiments import xla_flags

    def starts(flags: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
        argv = [sys.executable, "-c", "import jax; jax.devices()"]
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)

    proc = starts(" ".join(xla_flags.GPU_FLAGS))
    assert proc.returncode == 0, proc.stderr[-300:]
    proc = starts("--xla_gpu_no_such_flag=true")
    assert proc.returncode != 0 and "Unknown flag" in proc.stderr  # the check can fail


def test_gpa_inner_at_mu_x_zero_is_adamw_and_is_evaluated_at_x(tmp_path):
    """inner.optimizer=gpa under DDP: at mu_x = 0 GPA is AdamW (x = z = y), so the run's
    every loss equals AdamW's; at mu_x > 0 the eval runs at x = (y - (1 - mu_y) z) / mu_y,
    not at the parameters y the replicas hold."""
    import co2jax

    def run(name, *overrides):
        cfg = _micro(
            tmp_path / name, "outer.algorithm=ddp", "train.rounds=2", "eval.every=1", *overrides
        )
        return train.train(cfg)

    adamw = run("adamw")
    gpa0 = run("gpa0", "inner.optimizer=gpa", "inner.gpa_mu_x=0.0")
    for a, b in zip(adamw.history, gpa0.history, strict=True):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5)
        assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-5)
    gpa = run("gpa", "inner.optimizer=gpa", "inner.gpa_mu_x=0.9")
    gpa_cfg = _micro(
        tmp_path / "gpa", "outer.algorithm=ddp", "inner.optimizer=gpa", "inner.gpa_mu_x=0.9"
    )
    at_x = inner_lib.evaluated_params(gpa_cfg.inner, gpa.state)
    z = next(
        n
        for n in jax.tree.leaves(
            gpa.state.inner_state, is_leaf=lambda n: isinstance(n, co2jax.GPAState)
        )
        if isinstance(n, co2jax.GPAState)
    ).z
    want = jax.tree.map(lambda y, z: (y - 0.3 * z) / 0.7, gpa.state.params, z)
    for got, expect in zip(jax.tree.leaves(at_x), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expect), rtol=1e-5, atol=1e-6)
    pairs = zip(jax.tree.leaves(at_x), jax.tree.leaves(gpa.state.params), strict=True)
    assert max(np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in pairs) > 1e-4  # x != y


def test_gpa_settings_are_refused_for_adamw(tmp_path):
    with pytest.raises(ValueError, match=r"inner.gpa_mu_x=0.9: ignored unless inner.optimizer=gpa"):
        train.train(_micro(tmp_path, "inner.gpa_mu_x=0.9"))
    with pytest.raises(ValueError, match=r"inner.gpa_mu_y=0.0: must be in \(0, 1\]"):
        train.train(
            _micro(tmp_path, "outer.algorithm=ddp", "inner.optimizer=gpa", "inner.gpa_mu_y=0.0")
        )
    with pytest.raises(
        ValueError, match=r"inner.optimizer='gpa': GPA keeps .* outer.algorithm=ddp"
    ):
        train.train(_micro(tmp_path, "inner.optimizer=gpa"))
