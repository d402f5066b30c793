"""The method registry (graft_exp/methods.py): every declared method resolves to components, components
answer what the driver, the exchange and the backends ask, and unknown names fail listing the valid ones."""

from __future__ import annotations

import ast
from pathlib import Path

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
from graft_exp.objective import OBJECTIVES, LossSpec
from graft_exp.registry import RuleParam


def method_config(**overrides):
    return OmegaConf.merge(OmegaConf.structured(MethodConfig(name="test")), overrides)


@pytest.mark.parametrize("name", sorted(methods.METHODS))
def test_every_declared_method_resolves_and_its_loss_is_registered(compose_cfg, name):
    cfg = compose_cfg(f"method={name}")
    spec = methods.resolve(cfg.method)
    assert spec.objective in OBJECTIVES
    assert spec.co_train == (spec.selection.transfers or spec.peer_loss.transfers)
    assert methods.declaration(name).display


@pytest.mark.parametrize(("key", "registry"), [("selection", methods.SELECTIONS), ("peer_loss", methods.PEER_LOSSES),
                                               ("admission", methods.ADMISSIONS), ("advantages", methods.ADVANTAGES),
                                               ("ratio", methods.RATIOS), ("peer_position", methods.PEER_POSITIONS),
                                               ("peer_responses", methods.PEER_RESPONSES), ("source", methods.SOURCES)])
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
    assert not graft.loss.needs_reference_model and graft.loss.hacpo_kl_coef == 0
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
    assert (spec.hacpo_self_clip_low, spec.hacpo_self_clip_high, spec.hacpo_cross_clip_delta,
            spec.hacpo_cross_clip_step, spec.hacpo_kl_coef) == (HACPO_SELF_CLIP_LOW, HACPO_SELF_CLIP_HIGH,
                                                              HACPO_CROSS_CLIP_DELTA, HACPO_CROSS_CLIP_STEP,
                                                              HACPO_KL_COEF)
    assert HacpoConfig().minibatch_prompts == HACPO_MINIBATCH_PROMPTS
    assert LossSpec(kind="hacpo").hacpo_kl_coef == 0


def test_cost_families_are_in_the_cost_tables():
    from graft_exp.launching.jobs import CO_TRAIN_GPU_HOURS, GRPO_GPU_HOURS, PAPER_PAIR
    known = set(CO_TRAIN_GPU_HOURS) | set(GRPO_GPU_HOURS[PAPER_PAIR[0]])
    assert {d.cost_family for d in methods.METHODS.values()} <= known


#: Attributes that hold a method's or a component's name.
NAME_FIELDS = {"name", "source", "selection", "peer_loss", "admission", "ratio", "peer_position", "advantages",
               "peer_responses", "kind"}


def name_comparisons(path: Path) -> list[str]:
    """Method routing by name: ``x.<component> == "literal"`` (or !=, in, not in a literal tuple; ``name`` only
    of a method), ``method.startswith(...)``, and a method's name compared with anything."""
    names = set(methods.METHODS)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            literals = [s.value for s in sides if isinstance(s, ast.Constant) and isinstance(s.value, str)]
            literals += [e.value for s in sides if isinstance(s, ast.Tuple) for e in s.elts
                         if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            fields = [s for s in sides if isinstance(s, ast.Attribute) and s.attr in NAME_FIELDS
                      and (s.attr != "name" or ast.unparse(s.value).split(".")[-1] == "method")]
            if (fields and literals) or set(literals) & names:
                found.append(f"{path}:{node.lineno}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "startswith"
              and isinstance(node.func.value, ast.Name) and node.func.value.id == "method"):
            found.append(f"{path}:{node.lineno}")
    return found


def test_no_method_routing_by_name_in_the_driver_exchange_backends_or_launchers():
    root = Path(methods.__file__).parent
    files = [root / "driver.py", root / "step_record.py", root / "exchange.py", root / "objective.py",
             *sorted((root / "backends").rglob("*.py")), *sorted((root / "launching").rglob("*.py")),
             *sorted((root / "sweep").rglob("*.py"))]
    assert not [hit for path in files for hit in name_comparisons(path)]


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` names in an import: at the top, inside functions (lazy) and under TYPE_CHECKING."""
    tree = ast.parse(path.read_text())
    found = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return found


def package_imports() -> dict[str, set[str]]:
    """graft_exp's modules (dotted names) and the package modules each imports."""
    root = Path(methods.__file__).parent
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return {name: {m for m in imported_modules(path) if m in modules and m != name} for name, path in modules.items()}


def test_control_flows_one_way():
    """docs/design.md's layers: backends never import the driver; the driver, the contract, the exchange and
    the objective never import a backend; the method registry imports nothing of the loop; no two modules of the
    package import each other, directly or round a longer circle (lazy and type-only imports counted)."""
    root = Path(methods.__file__).parent
    for path in (root / "backends").rglob("*.py"):
        assert "graft_exp.driver" not in imported_modules(path), path
    for name in ("driver.py", "contract.py", "exchange.py", "objective.py", "methods.py", "config.py"):
        assert not any(m.startswith("graft_exp.backends") for m in imported_modules(root / name)), name
    # the registry names the pure math of graft_exp.algorithms, its peer losses (the receiver batch they build)
    # and the receiver losses (graft_exp.objective, which itself needs only the name tables and the math)
    below = {"algorithms", "objective", "registry", "peer_losses", "receiver", "rollouts", "hyperparameters"}
    assert not [m for m in imported_modules(root / "methods.py")
                if m.startswith("graft_exp") and m.split(".")[1] not in below]
    assert not [m for m in imported_modules(root / "objective.py")
                if m.startswith("graft_exp") and m.split(".")[1] not in {"algorithms", "registry", "hyperparameters"}]
    graph, circles = package_imports(), []

    def visit(module: str, path: list[str]) -> None:
        for imported in sorted(graph[module]):
            if imported in path:
                circles.append(path[path.index(imported):] + [imported])
            elif imported not in done:
                visit(imported, path + [imported])
        done.add(module)
    done: set[str] = set()
    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    assert not circles, f"import circles: {circles}"


def design_layers() -> dict[str, int]:
    """docs/design.md's architecture table: each unit (a module, ``package/``, ``tiny/__main__``) and its layer,
    0 at the bottom."""
    text = (Path(methods.__file__).parents[1] / "docs" / "design.md").read_text()
    block = text.split("## The architecture in one picture", 1)[1].split("```", 2)[1]
    rows = [line.split("│") for line in block.splitlines() if line.count("│") == 2][1:]   # the header row out
    return {unit: len(rows) - 1 - i for i, row in enumerate(rows) for unit in row[1].split()}


def unit_of(module: str) -> str | None:
    """The design table's unit of a ``graft_exp`` module name (None: the package itself)."""
    root = Path(methods.__file__).parent
    parts = module.split(".")[1:]
    if not parts:
        return None
    if (root / parts[0]).is_dir():
        return "tiny/__main__" if parts[:2] == ["tiny", "__main__"] else parts[0] + "/"
    return parts[0]


def test_the_design_table_lists_every_module_and_imports_only_go_down():
    layers, root = design_layers(), Path(methods.__file__).parent
    units = {unit_of("graft_exp." + ".".join(p.relative_to(root).with_suffix("").parts))
             for p in root.rglob("*.py") if p.name != "__init__.py" or p.parent != root}
    assert units == set(layers), f"not in docs/design.md's table: {sorted(units - set(layers))}; " \
                                 f"no such module: {sorted(set(layers) - units)}"
    upward = []
    for path in root.rglob("*.py"):
        source = unit_of("graft_exp." + ".".join(path.relative_to(root).with_suffix("").parts))
        for module in imported_modules(path):
            target = unit_of(module) if module.startswith("graft_exp") else None
            if source and target and target in layers and layers[target] > layers[source]:
                upward.append(f"{source} imports {module}")
    assert not upward, upward


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
