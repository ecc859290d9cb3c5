"""The package's structure, read from its source (``ast``): no import circles, counting lazy imports inside
functions and imports for type annotations (``if TYPE_CHECKING:``): a circle hidden in either is still a
circle of the design; the engine names no mode and no path; path names are the path files' own; no
module outside ``modes/`` asks which mode is active; the servers never read the ServerOptimizer."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from poseidon_torch import paths

PACKAGE = Path(__file__).resolve().parents[1] / "poseidon_torch"
MODE_CLASSES = {"Mode", "BSP", "PipeSGD", "ServerMode", "PipeServer", "SSP", "Periodic", "LocalSGD", "DiLoCo"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path, name: str) -> set[str]:
    """The package modules ``path`` imports (``from .x import y`` may name a submodule ``x.y``)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            target = f"{base}.{node.module}" if node.module else base
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("poseidon_torch"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("poseidon_torch"))
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {m for m in _imports(path, name) if m in modules and m != name} for name, path in modules.items()}


def test_no_import_circles():
    graph = import_graph()
    # a package's __init__ re-exports its modules: an edge into a package means "import its __init__"
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt.startswith(node + "."):  # a package importing its own submodules
                continue
            if state.get(nxt) == 1 and not node.startswith(nxt + "."):
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def _string_constants(path: Path) -> list[str]:
    return [node.value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def test_the_engine_names_no_mode_and_no_path():
    engine = PACKAGE / "engine.py"
    text = engine.read_text()
    assert not re.findall(r"server|delay|stalen", text, re.IGNORECASE)
    named = [value for value in _string_constants(engine) if value in paths.names()]
    assert not named, named
    names = {node.id for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Name)}
    assert not names & ({"PS", "SFB"} | {cls.__name__ for cls in paths.REGISTERED}), names


def test_path_names_are_spelled_only_in_the_path_files():
    """A path is known elsewhere through the registry (``overrides={"fc": "SFB"}`` resolves there)."""
    for name, path in _modules().items():
        if name.startswith("poseidon_torch.paths"):
            continue
        named = [value for value in _string_constants(path) if value in paths.names()]
        assert not named, (name, named)


def test_no_module_outside_modes_asks_which_mode_is_active():
    for name, path in _modules().items():
        if name.startswith("poseidon_torch.modes"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("isinstance", "type"):
                asked = {n.id for arg in node.args[1:] for n in ast.walk(arg) if isinstance(n, ast.Name)}
                assert not asked & MODE_CLASSES, (name, ast.unparse(node))
            if isinstance(node, ast.Attribute) and node.attr == "name" and "mode" in ast.unparse(node.value):
                raise AssertionError(f"{name} reads a mode's name: {ast.unparse(node)}")


def test_the_servers_read_nothing_of_the_server_optimizer():
    """The shards take a plain spec: only the package's front and the framework glue import the optimizer."""
    graph = import_graph()
    importers = sorted(name for name, imported in graph.items() if "poseidon_torch.optimizer" in imported)
    assert importers == ["poseidon_torch", "poseidon_torch.integrations._strategy",
                         "poseidon_torch.integrations.accelerate", "poseidon_torch.integrations.hf"]
