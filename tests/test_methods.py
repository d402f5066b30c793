"""The method registry (graft_exp/methods/__init__.py): every declared method resolves to components, components
answer what the driver, the exchange and the backends ask, and unknown names fail listing the valid ones."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from graft_exp import methods
from graft_exp.algorithms import (
    HACPO_CROSS_CLIP_DELTA,
    HACPO_CROSS_CLIP_STEP,
    HACPO_KL_COEF,
    HACPO_SELF_CLIP_HIGH,
    HACPO_SELF_CLIP_LOW,
)
from graft_exp.config import ConfigError, HacpoConfig, MethodConfig, validate
from graft_exp.hyperparameters import HACPO_MINIBATCH_PROMPTS
from graft_exp.methods.objective import OBJECTIVES, LossSpec
from graft_exp.methods.registry import RuleParam


def method_config(**overrides):
    return OmegaConf.merge(OmegaConf.structured(MethodConfig(name="test")), overrides)


@pytest.mark.parametrize("name", sorted(methods.METHODS))
def test_every_declared_method_resolves_and_its_loss_is_registered(compose_cfg, name):
    cfg = compose_cfg(f"method={name}")
    spec = methods.resolve(cfg.method)
    assert spec.objective in OBJECTIVES
    assert spec.co_train == methods.co_trains(cfg.method) == (not name.startswith("grpo_"))
    assert methods.declaration(name).display


@pytest.mark.parametrize(("key", "registry"), [("selection", methods.SELECTIONS), ("peer_loss", methods.PEER_LOSSES),
                                               ("admission", methods.ADMISSIONS), ("advantages", methods.ADVANTAGES),
                                               ("ratio", methods.RATIOS), ("peer_position", methods.PEER_POSITIONS),
                                               ("peer_responses", methods.PEER_RESPONSES), ("source", methods.SOURCES),
                                               ("sampling", methods.SAMPLINGS)])
def test_an_unknown_component_fails_with_the_valid_names(compose_cfg, tmp_path, key, registry):
    with pytest.raises(methods.UnknownName) as err:
        methods.resolve(method_config(**{key: "balancd"}))
    assert f"method.{key}='balancd'" in str(err.value) and all(name in str(err.value) for name in registry)
    cfg = compose_cfg(f"tracking.uri=sqlite:///{tmp_path}/m.db", f"method.{key}=balancd")
    with pytest.raises(ConfigError, match=f"method.{key}='balancd' is not one of {', '.join(registry)}"):
        validate(cfg)


def test_an_undeclared_method_name_fails_with_the_declared_ones(compose_cfg, tmp_path):
    with pytest.raises(ConfigError, match=r"method='graft_typo' is not declared.*graft_no_gate"):
        validate(compose_cfg(f"tracking.uri=sqlite:///{tmp_path}/m.db", "method.name=graft_typo"))
    with pytest.raises(ValueError, match="registered twice"):
        methods.SELECTIONS.register("balanced", methods.fixed(None))


def test_components_answer_what_the_code_asks(compose_cfg):
    hacpo = methods.resolve(compose_cfg("method=hacpo").method)
    assert hacpo.loss.needs_reference_model and hacpo.peer_loss.receiver_groups(16) == 32 and hacpo.selection.every_prompt
    assert hacpo.minibatch_prompts(compose_cfg().train) == 64
    assert hacpo.peer_loss.clip_range(hacpo.config) == (hacpo.config.hacpo.self_clip_low, hacpo.config.hacpo.self_clip_high)
    assert not methods.resolve(compose_cfg("method=hacpo", "method.hacpo.kl_coef=0").method).loss.needs_reference_model
    graft = methods.resolve(compose_cfg("method=graft").method)
    train = compose_cfg().train
    assert not graft.loss.needs_reference_model and graft.loss.kl_coef == 0
    assert graft.minibatch_prompts(train) == train.minibatch_prompts
    assert not graft.selection.one_direction_ok and not graft.replays_stored_log
    stored = methods.resolve(compose_cfg("method=graft_stored").method)
    assert stored.replays_stored_log and stored.source.replays_log_of in methods.METHODS
    sgt = methods.resolve(compose_cfg("method=sgt").method).loss
    assert "nll_rows" in sgt.columns and not sgt.sequence_level
    assert methods.resolve(compose_cfg("method=graft_seq_ratio").method).loss.kind == "sequence_ratio"
    assert methods.resolve(compose_cfg("method=grpo_n8").method).loss.kind == "graft"


def test_hacpo_s_released_settings_reach_its_loss_spec():
    """Written once (graft_exp.hyperparameters); the resolved method's loss spec carries the config's settings
    (the peer clamp's delta as 1 - init, as the pure function's default), and the KL is the peer loss's."""
    spec = methods.resolve(OmegaConf.structured(MethodConfig(name="hacpo", peer_loss="hacpo"))).loss
    assert spec.settings == {"self_clip_low": HACPO_SELF_CLIP_LOW, "self_clip_high": HACPO_SELF_CLIP_HIGH,
                             "cross_clip_delta": HACPO_CROSS_CLIP_DELTA,
                             "cross_clip_step": HACPO_CROSS_CLIP_STEP}
    assert spec.kl_coef == HACPO_KL_COEF
    assert HacpoConfig().minibatch_prompts == HACPO_MINIBATCH_PROMPTS
    assert LossSpec(kind="hacpo").kl_coef == 0


def test_cost_families_are_in_the_cost_tables():
    from graft_exp.launching.jobs import CO_TRAIN_GPU_HOURS, GRPO_GPU_HOURS, PAPER_PAIR
    known = set(CO_TRAIN_GPU_HOURS) | set(GRPO_GPU_HOURS[PAPER_PAIR[0]])
    assert {d.cost_family for d in methods.METHODS.values()} <= known


def test_a_rule_reads_its_parameters_from_the_method_config(request, compose_cfg):
    """A rule registered with ``params`` gets them from ``method.params`` (its factory receives the config);
    a missing one and one no rule reads fail naming the keys; only a non-empty ``params`` enters the run key."""
    import torch

    from graft_exp.algorithms import complementary_candidates
    from graft_exp.tracking import run_key

    def at_least(method):
        fraction = float(method.params.min_solved)
        keep = lambda k_s, k_r, n: complementary_candidates(k_s, k_r, n) & (k_s >= fraction * n)
        return methods.Selection(lambda k_a, k_b, n, g: (keep(k_a, k_b, n), keep(k_b, k_a, n)))
    methods.SELECTIONS.register("at_least", at_least, params={"min_solved": RuleParam(float, 0.0, 1.0)})
    request.addfinalizer(lambda: (methods.SELECTIONS.pop("at_least"), methods.SELECTIONS.params.pop("at_least")))
    # eq. (3): the receiver solved none, the source 1..7 of 8; then at least min_solved x 8 of them
    k_a, k_b = torch.tensor([7, 3, 5, 0]), torch.tensor([0, 0, 0, 4])
    for fraction, a_to_b, b_to_a in ((0.5, [True, False, True, False], [False, False, False, True]),
                                     (0.75, [True, False, False, False], [False] * 4)):
        method = methods.resolve(method_config(selection="at_least", params={"min_solved": fraction}))
        assert [m.tolist() for m in method.selection.rule(k_a, k_b, 8, None)] == [a_to_b, b_to_a]
    with pytest.raises(methods.UnknownName, match=r"method.selection=at_least reads method.params.min_solved"):
        methods.resolve(method_config(selection="at_least"))
    with pytest.raises(methods.UnknownName, match=r"method.params.min_solvd is read by none of test's rules; "
                                                  r"they read: min_solved"):
        methods.resolve(method_config(selection="at_least", params={"min_solved": 0.5, "min_solvd": 0.5}))
    with pytest.raises(methods.UnknownName, match=r"method.params.x is read by none of test's rules; they read: nothing"):
        methods.resolve(method_config(params={"x": 1}))
    # typed at registration: a value outside its range, of another type or null is named with the range
    for value, shown in ((1.5, "1.5"), ("abc", "abc"), (None, "null"), (True, "True"), (float("nan"), "nan")):
        with pytest.raises(methods.UnknownName, match=rf"method.params.min_solved={shown}: method.selection=at_least "
                                                      r"needs a number in \[0, 1\]"):
            methods.resolve(method_config(selection="at_least", params={"min_solved": value}))
    methods.resolve(method_config(selection="at_least", params={"min_solved": 1}))   # an int is a number
    # ... before anything exists: validation's one line, from the command line's spelling
    for bad in ("1.5", "abc", "null"):
        with pytest.raises(ConfigError, match=rf"method.params.min_solved={bad}: .* needs a number in \[0, 1\]"):
            validate(compose_cfg("method.selection=at_least", f"+method.params.min_solved={bad}"))
    cfg = compose_cfg()
    with_params = compose_cfg("method.selection=at_least", "+method.params.min_solved=0.5")
    assert run_key(compose_cfg("method.selection=at_least")) == run_key(OmegaConf.merge(cfg, {"method": {"selection": "at_least"}}))
    assert run_key(with_params) != run_key(compose_cfg("method.selection=at_least"))


def test_a_rule_parameter_declares_its_type_and_range():
    assert RuleParam(int, 1).accepts(3) and not RuleParam(int, 1).accepts(2.5) and not RuleParam(int, 1).accepts(0)
    assert RuleParam(int, 1).describe() == "an integer >= 1" and RuleParam(bool).describe() == "true or false"
    assert RuleParam(bool).accepts(False) and not RuleParam(bool).accepts(0)
    assert RuleParam(float, high=0.5).describe() == "a number <= 0.5" and RuleParam().accepts(-1e9)
    with pytest.raises(TypeError, match="params maps each name to a RuleParam"):
        methods.SELECTIONS.register("untyped", lambda method: None, params={"x": float})
    assert "untyped" not in methods.SELECTIONS
