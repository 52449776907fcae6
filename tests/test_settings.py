"""Each algorithm's own settings: declared once (typed, described, validated), a setting it does
not declare cannot be set, validation runs once per run, and the capabilities the registry
derives from what each algorithm builds agree with what the drivers do with it."""

from __future__ import annotations

import dataclasses

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import textbook as tb
from test_engine import engine_loss, textbook_batch

import co2jax
from co2jax.algorithms import registry, settings
from co2jax.axes import REPLICA

H, LR = tb.REGISTERED_H, 0.1
LEAVES = {f"layer{i}": jnp.zeros(8) for i in range(4)}  # one leaf per fragment


def _declared(name: str) -> set[str]:
    return {f.name for f in dataclasses.fields(registry.REGISTRY[name])}


@pytest.mark.parametrize("name", registry.NAMES)
def test_every_setting_is_typed_described_and_validated(name):
    s = registry.settings(name)
    assert s.algorithm == name and dataclasses.is_dataclass(s)
    for f in dataclasses.fields(s):
        assert isinstance(f.type, str) and f.type, f.name
        assert f.metadata.get("help"), f"{name}: outer.{f.name} has no description"
    assert s.validate(registry.Bounds(sync_every=8, rounds=4, replicas=4, layers=4)) is s
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.algorithm = "x"


@pytest.mark.parametrize("name", registry.NAMES)
def test_a_setting_the_algorithm_does_not_declare_cannot_be_set(name):
    others = set().union(*(_declared(n) for n in registry.NAMES)) - _declared(name)
    for field in sorted(others):
        with pytest.raises(ValueError, match=rf"^outer\.{field}=1: {name} has no such setting"):
            registry.settings(name, **{field: 1})
    if "learning_rate" in _declared(name):
        with pytest.raises(ValueError, match=r"^outer\.lerning_rate=1: .*did you mean outer\.l"):
            registry.settings(name, lerning_rate=1)


def test_choices_are_checked_by_validate():
    with pytest.raises(ValueError, match=r"^outer\.penalty='hard': must be one of"):
        registry.settings("co2", penalty="hard").validate()
    with pytest.raises(ValueError, match=r"^outer\.algorithm='co2': must be 'diloco' for Di"):
        registry.REGISTRY["diloco"](algorithm="co2").validate()  # not co2's class


def test_an_inherited_check_runs_for_every_algorithm_with_the_piece():
    """A shared piece's rule (the outer learning rate > 0) refuses in every algorithm that
    takes the piece: nobody restates it and nobody can forget it."""
    with_lr = [n for n in registry.NAMES if issubclass(
        registry.REGISTRY[n], settings.LearningRate)]  # fmt: skip
    assert len(with_lr) >= 10
    for name in with_lr:
        with pytest.raises(ValueError, match=r"^outer\.learning_rate=0: must be > 0"):
            registry.settings(name, learning_rate=0).validate()


def _observed_every_step(name: str) -> bool:
    """Replica 0's parameters after 2H + 1 inner steps (past a moment average every round)
    depend on the other replicas' gradients only if the inner transform exchanges something
    over the replica axis: the gradient (DDP), a part of the parameters (SPARTA), a
    compressed momentum (DeMo) or the optimizer's moments (DES-LOC)."""
    problem = tb.make_problem(replicas=4, examples=2, dim=16, seed=3)
    _, inner = harness.registered(name, problem, LR, H)
    params = harness.initial_params(problem)
    noise = jax.tree.map(lambda x: jax.random.normal(jax.random.key(0), x.shape, x.dtype), params)
    step = jax.jit(jax.vmap(inner.update, axis_name=REPLICA))

    def replica_0(others: float) -> np.ndarray:
        grads = jax.tree.map(lambda g: g.at[1:].multiply(others), noise)
        p, state = params, jax.vmap(inner.init, axis_name=REPLICA)(params)
        for _ in range(2 * H + 1):
            updates, state = step(grads, state, p)
            p = optax.apply_updates(p, updates)
        return np.asarray(harness.flatten(p))[0]

    return not np.array_equal(replica_0(1.0), replica_0(-2.0))


def _engine_plan(name: str, **fields):
    problem = tb.make_problem(replicas=4, examples=2, dim=16, seed=3)
    outer, inner = harness.registered(name, problem, LR, H, **fields)
    mesh = co2jax.make_mesh(replica=4, data=2, devices=jax.devices("cpu")[:8])
    # Pallas' interpreter is not typed for shard_map's varying-axis check: off only for it
    interpreted = fields.get("implementation") == "interpret"
    trainer = co2jax.RoundTrainer(
        engine_loss, inner, outer, mesh, H, check_vma=not interpreted,
        reducer="all_gather" if outer.reducer.exact else "auto",  # the fused kernel's form
    )  # fmt: skip
    state = trainer.init(harness.unflatten(jnp.asarray(problem.theta0, jnp.float32)))
    program = trainer.program(state)
    for _ in range(3):  # the plan runs
        state, _ = trainer.round(state, textbook_batch(problem, H))
    return program.plan, harness.flatten(jax.device_get(state.params))


@pytest.mark.parametrize("name", registry.NAMES)
@pytest.mark.cases("algorithms", 3)
def test_derived_capabilities_are_what_the_drivers_do(name):
    caps = registry.capabilities(name)
    # every_step: the replicas' inner steps exchange something (DDP, DeMo, SPARTA, DES-LOC)
    assert caps.every_step == _observed_every_step(name)
    # the round engine's plan: a transfer in flight over the whole round, fragments, fused
    fused = {"implementation": "interpret"} if "implementation" in _declared(name) else {}
    plan, params = _engine_plan(name, **fused)
    applies = {t.apply for t in plan.transfers}
    assert caps.fragments == (len(applies) > 1), plan.transfers
    # sent before the round's last step and applied after it (whole, or spread in chunks)
    early = any(t.send is not None and t.send < t.apply == H for t in plan.transfers)
    assert caps.delayed == (early and len(applies) == 1), plan.transfers
    assert caps.fusable == (plan.reducer_kind == "all_gather" and bool(fused)), plan.kinds
    # the jobs driver exchanges with every replica: a group-only reducer is refused there
    outer, _ = harness.registered(name, tb.make_problem(replicas=4), LR, H)
    assert caps.gossip == (outer.reducer.reach != "all")
    # the pieces an algorithm takes are settings it accepts, and they change what it builds
    if caps.compressible:
        s = registry.settings(name, compression="int8").validate(registry.Bounds(H))
        built = s.outer(registry.Context(H, LEAVES, LR, num_replicas=4))
        assert not built.reducer.exact
    else:
        with pytest.raises(ValueError, match="no such setting"):
            registry.settings(name, compression="int8")
    if caps.guardable:
        s = registry.settings(name, skip_nonfinite=True)
        built = s.outer(registry.Context(H, LEAVES, LR, num_replicas=4))
        assert built.recovers_nonfinite
    else:
        with pytest.raises(ValueError, match="no such setting"):
            registry.settings(name, skip_nonfinite=True)
    if caps.outer_transform:  # the optimizer setting reaches the outer step
        _, adam = _engine_plan(name, **fused, optimizer="adam")
        assert np.abs(params - adam).max() > 1e-6
    else:
        with pytest.raises(ValueError, match="no such setting"):
            registry.settings(name, optimizer="adam")


def test_capabilities_as_declared_before_except_diloco_x_guards():
    """The flags the registry used to declare by hand, now derived: the same, except
    DiLoCoX, which was declared unguardable and guards itself (its skip_nonfinite)."""
    flags = {n: registry.capabilities(n) for n in registry.NAMES}
    assert registry.names_where("delayed") == ("delayed_diloco", "eager_diloco", "co2", "diloco_x")
    assert registry.names_where("every_step") == (
        "ddp",
        "demo",
        "sparta",
        "sparta_diloco",
        "desloc",
    )
    assert registry.names_where("fragments") == ("streaming_diloco", "cocodc")
    assert registry.names_where("gossip") == ("noloco", "hierarchical_diloco")
    assert flags["diloco_x"].guardable and not flags["noloco"].guardable


# ---------------------------------------------------------------------------------------------
# adding an algorithm: its settings class beside its factory, registered once


@pytest.fixture
def diloco_wd():
    """A new algorithm with one new setting, added the way docs/architecture.md says (here
    registered inside the test; a real one is a module under co2jax/algorithms/, imported by
    the registry): DiLoCo whose outer step sees ``Delta + wd * theta``."""

    @registry.register("DiLoCo with a coupled outer weight decay (a test's example)")
    @dataclasses.dataclass(frozen=True)
    class DiLoCoWDSettings(settings.Settings, settings.OuterStep, settings.Guard):
        """DiLoCo with an outer weight decay: the outer step takes Delta + wd * theta."""

        algorithm: str = settings.setting("diloco_wd", "the algorithm")
        outer_weight_decay: float = settings.setting(0.1, "wd: adds wd * theta to Delta (>= 0)")

        def check(self, bounds) -> None:
            if self.outer_weight_decay < 0:
                settings.fail("outer_weight_decay", self.outer_weight_decay, "must be >= 0")

        def build(self, context, reduce):
            decay = optax.add_decayed_weights(self.outer_weight_decay)
            return co2jax.diloco(optax.chain(decay, self.transform(context)), reduce=reduce)

    yield "diloco_wd"
    del registry.REGISTRY["diloco_wd"]
    registry.capabilities.cache_clear()


def _diloco_wd_loop(problem, lr, H, rounds, eta, mu, wd):
    """g = mean_r(theta - theta_r) + wd * theta; b <- mu*b + g; theta <- theta - eta*(g + mu*b)."""
    anchor, b, out = problem.theta0.copy(), 0.0, []
    for _ in range(rounds):
        local = [tb.inner_sgd(problem, r, anchor, lr, H) for r in range(problem.replicas)]
        g = np.mean([anchor - x for x in local], axis=0) + wd * anchor
        b = mu * b + g
        anchor = anchor - eta * (g + mu * b)
        out.append(np.stack([anchor] * problem.replicas))
    return np.array(out)


def test_adding_an_algorithm_with_one_new_setting(diloco_wd, tmp_path, capsys):
    from experiments import checks, train
    from experiments import config as config_lib

    # the library: built from its settings, equal to its loop
    problem = tb.make_problem(replicas=4, examples=2, dim=16, seed=4)
    s = registry.settings(diloco_wd, learning_rate=0.5, momentum=0.8, outer_weight_decay=0.3)
    params = jax.tree.map(lambda x: x[0], harness.initial_params(problem))
    outer = s.validate().outer(registry.Context(H, params, LR, num_replicas=4))
    got, _ = harness.run_vmap(outer, problem, LR, H, 3)
    want = _diloco_wd_loop(problem, LR, H, 3, 0.5, 0.8, 0.3)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    caps = registry.capabilities(diloco_wd)
    assert caps.outer_transform and caps.guardable and not (caps.compressible or caps.delayed)
    # the experiments: its setting is set, checked and described; nobody else takes it
    micro = config_lib.preset("micro")
    cfg = config_lib.override(micro, ["outer.algorithm=diloco_wd", "outer.outer_weight_decay=0.2"])
    assert checks.validate(cfg).outer.outer_weight_decay == 0.2
    with pytest.raises(config_lib.ConfigError, match=r"^outer\.outer_weight_decay=-1\.0: must"):
        checks.validate(config_lib.override(cfg, ["outer.outer_weight_decay=-1"]))
    for other in (n for n in registry.NAMES if n != diloco_wd):  # NAMES: now with it
        with pytest.raises(config_lib.ConfigError, match=r"no such setting \(a setting of dil"):
            config_lib.override(micro, [f"outer.algorithm={other}", "outer.outer_weight_decay=1"])
    with pytest.raises(SystemExit):
        train.main(["--help", "outer.algorithm=diloco_wd"])
    line = next(s for s in capsys.readouterr().out.splitlines() if "outer_weight_decay" in s)
    assert "float" in line and "0.1" in line and "adds wd * theta" in line


@pytest.mark.parametrize("name", registry.NAMES)
def test_what_a_run_records_comes_from_the_algorithm(name):
    """A run's records of an algorithm's state come from the algorithm's own hook
    (``Settings.recorded``: every piece's ``metrics``), never from a field name read outside:
    the guard's skipped steps, CO2's clipped fraction and penalty scale."""
    s = registry.settings(name)
    outer = s.outer(registry.Context(H, LEAVES, LR, num_replicas=2))
    state = jax.vmap(outer.init)(jax.tree.map(lambda x: jnp.stack([x, x]), LEAVES))
    recorded = s.recorded(state)
    assert all(isinstance(k, str) for k in recorded)
    guarded = isinstance(s, settings.Guard) and s.skip_nonfinite  # by build or by itself
    assert recorded.get("skipped") == (0 if guarded else None)
    if name == "co2":
        assert recorded["penalty_scale"] == 1.0 and recorded["clip_fraction"] is None
        clipped = registry.settings("co2", clip_threshold=1e-9)
        outer = clipped.outer(registry.Context(H, LEAVES, LR, num_replicas=2))
        state = jax.vmap(outer.init)(jax.tree.map(lambda x: jnp.stack([x, x]), LEAVES))
        assert clipped.recorded(state)["clip_fraction"] == 0.0  # the momentum starts at 0


def test_every_state_roles_names_its_own_fields():
    """Each state type's ``ROLES`` is checked against its fields when the class is defined
    (``co2jax.protocol.checked_roles``); every such type in the package is decorated, so a
    renamed field cannot leave a role pointing nowhere."""
    import importlib
    import inspect
    import pkgutil

    from co2jax.protocol import StateRoles, checked_roles

    found = {}
    for info in pkgutil.walk_packages(co2jax.__path__, "co2jax."):
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if isinstance(cls.__dict__.get("ROLES"), StateRoles):
                found[cls.__qualname__] = cls
    assert len(found) >= 9, sorted(found)
    for cls in found.values():
        assert checked_roles(cls) is cls
        source = inspect.getsource(cls)
        assert source.lstrip().startswith("@checked_roles"), cls.__name__
