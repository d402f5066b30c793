"""The architecture docs/design.md draws, held against the code: control flows one way (no backend imports the
driver, the driver no backend), the layer table lists every module and imports only go down, no import circle, and
no method is routed by its name outside the registry."""

from __future__ import annotations

import ast
from pathlib import Path

import graft_exp
from graft_exp import methods

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
    root = Path(graft_exp.__file__).parent
    files = [root / "driver.py", root / "step_record.py", root / "methods" / "exchange.py", root / "methods" / "objective.py",
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
    root = Path(graft_exp.__file__).parent
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return {name: {m for m in imported_modules(path) if m in modules and m != name} for name, path in modules.items()}


def test_control_flows_one_way():
    """docs/design.md's layers: backends never import the driver; the driver, the contract, the exchange and
    the objective never import a backend; the method registry imports nothing of the loop; no two modules of the
    package import each other, directly or round a longer circle (lazy and type-only imports counted)."""
    root = Path(graft_exp.__file__).parent
    for path in (root / "backends").rglob("*.py"):
        assert "graft_exp.driver" not in imported_modules(path), path
    for name in ("driver.py", "contract.py", "methods/exchange.py", "methods/objective.py", "methods/__init__.py",
                 "config.py"):
        assert not any(m.startswith("graft_exp.backends") for m in imported_modules(root / name)), name
    # the registry names the pure math of graft_exp.algorithms, its peer losses (the receiver batch they build)
    # and the receiver losses (graft_exp.methods.objective, which itself needs only the name tables, the math, and the
    # receiver's rows and rollouts its per-row columns are built from)
    def outside(path: Path, allowed: set[str]) -> list[str]:
        return [m for m in imported_modules(path) if m.startswith("graft_exp")
                and ".".join(m.split(".")[1:3]) not in allowed and m.split(".")[1] not in allowed]
    assert not outside(root / "methods" / "__init__.py", {"algorithms", "methods.objective", "methods.registry",
                                                         "methods.peer_losses", "methods.receiver", "rollouts",
                                                         "hyperparameters"})
    assert not outside(root / "methods" / "objective.py", {"algorithms", "methods.registry", "hyperparameters",
                                                          "methods.receiver", "rollouts"})
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
    text = (Path(graft_exp.__file__).parents[1] / "docs" / "design.md").read_text()
    block = text.split("## The architecture in one picture", 1)[1].split("```", 2)[1]
    rows = [line.split("│") for line in block.splitlines() if line.count("│") == 2][1:]   # the header row out
    return {unit: len(rows) - 1 - i for i, row in enumerate(rows) for unit in row[1].split()}


def unit_of(module: str) -> str | None:
    """The design table's unit of a ``graft_exp`` module name (None: the package itself)."""
    root = Path(graft_exp.__file__).parent
    parts = module.split(".")[1:]
    if not parts:
        return None
    if (root / parts[0]).is_dir():
        return "tiny/__main__" if parts[:2] == ["tiny", "__main__"] else parts[0] + "/"
    return parts[0]


def test_the_design_table_lists_every_module_and_imports_only_go_down():
    layers, root = design_layers(), Path(graft_exp.__file__).parent
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
