"""Every import inside `verl/` points down the layers of docs/ARCHITECTURE.md, no modules import each
other in a circle, and `verl/` imports nothing from `search_r1`. Read from the source with `ast`
(imports inside functions count too), so nothing is imported to check it."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Lower number: lower layer. A module imports from its own layer or those below it.
LAYERS = {"foundation": 0, "workers": 1, "single_controller": 2, "trainer": 3}
PACKAGE_LAYER = {"verl.workers": "workers", "verl.single_controller": "single_controller",
                 "verl.trainer": "trainer"}   # everything else in verl/ is foundation


def layer(module: str) -> str:
    for package, name in PACKAGE_LAYER.items():
        if module == package or module.startswith(package + "."):
            return name
    return "foundation"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The modules `path` imports: `from a.b import c` counts as a.b.c where that is a module of
    verl/ (a submodule), as a.b otherwise (a name defined there)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:   # relative: from . import x, from ..a import b
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return found


def verl_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((ROOT / "verl").rglob("*.py"))}


def graph() -> dict[str, set[str]]:
    """module → the modules of verl/ it imports (a package's __init__ is left out: importing a
    submodule runs it, but it imports nothing here)."""
    modules = verl_modules()
    return {name: {m for m in imports(path) if m in modules and m != name and not _is_parent(m, name)}
            for name, path in modules.items()}


def _is_parent(package: str, module: str) -> bool:
    return module.startswith(package + ".")


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One circle of imports per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_every_import_in_verl_points_down_the_layers():
    upward = [f"{module} ({layer(module)}) imports {target} ({layer(target)})"
              for module, targets in graph().items() for target in sorted(targets)
              if LAYERS[layer(target)] > LAYERS[layer(module)]]
    assert not upward, "imports that point up the layers (foundation < workers < single_controller < " \
                       "trainer):\n" + "\n".join(upward)


def test_no_modules_of_verl_import_each_other_in_a_circle():
    assert not cycles(graph()), f"modules that import each other in a circle: {cycles(graph())}"


def test_verl_imports_nothing_from_search_r1():
    found = [f"{name} imports {m}" for name, path in verl_modules().items() for m in sorted(imports(path))
             if m == "search_r1" or m.startswith("search_r1.")]
    assert not found, "\n".join(found)


def test_the_checks_see_an_upward_import_and_a_circle():
    assert layer("verl.config.schema") == "foundation" and layer("verl.workers.actor") == "workers"
    assert layer("verl.trainer.main_ppo") == "trainer"
    assert layer("verl.single_controller.ray_group") == "single_controller"
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
