"""The package's module-level import graph: no circle, and the stages meet only where the design says.

Read from the source with ``ast`` (nothing is imported), so the test sees every module, including those whose
imports need torch or megatron. Only imports at module level count: an import inside a function is deferred on
purpose (a heavy dependency, or a stage reaching up at run time) and cannot form a circle at import time.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pipeline"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _top_level_imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The package modules ``path`` imports at module level (``if TYPE_CHECKING:`` blocks excluded)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.If):
                test = node.test
                if isinstance(test, ast.Name) and test.id == "TYPE_CHECKING":
                    continue
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    found.add(alias.name)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                found.add(base)
                for alias in node.names:
                    found.add(f"{base}.{alias.name}")  # ``from pkg import module``

    visit(tree.body)
    # Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` too, except those this module is inside: they are
    # already being initialised when it runs (a package's ``__init__`` importing its own modules is no circle).
    own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    closed: set[str] = set()
    for target in found:
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in known and prefix != name and (prefix not in own or i == len(parts)):
                closed.add(prefix)
    return closed


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports at module level."""
    modules = _modules()
    known = set(modules)
    return {name: _top_level_imports(path, name, known) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = walk(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = walk(node)
            if found:
                return found
    return None


def test_the_finder_sees_a_circle_where_there_is_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_reads_relative_parent_and_from_imports() -> None:
    graph = import_graph()
    assert "pipeline.errors" in graph["pipeline.sync.base"]
    # ``from pipeline.sync.base import X`` also runs ``pipeline.sync``'s ``__init__``; a module's own packages do not
    # count (they are being initialised when it runs).
    assert {"pipeline.sync", "pipeline.sync.base"} <= graph["pipeline.producers.sglang_client"]
    assert "pipeline.queue" not in graph["pipeline.queue.redis_streams"]
    assert find_cycle({"pipeline.queue": {"pipeline.queue.codec"}, "pipeline.queue.codec": set()}) is None


def test_no_module_level_import_circle_in_pipeline() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "module-level import circle: " + " -> ".join(cycle or [])


#: Every stage, and what sits above the stages; ``pipeline.rundir`` imports none of them.
STAGES = ("pipeline.queue", "pipeline.producers", "pipeline.consumers", "pipeline.sync", "pipeline.heldout",
          "pipeline.data", "pipeline.models", "pipeline.metrics", "pipeline.launch", "pipeline.cli",
          "pipeline.observe", "pipeline.benchmarks")


def test_the_stages_below_do_not_import_the_stages_above() -> None:
    """queue and sync use neither producers nor consumers; producers and consumers do not import each other, nor
    held-out evaluation, the launcher, the CLI or the observers above them; the recipe schema, prompt data and model
    specs import no stage (deferred imports inside functions excepted)."""
    above = {
        "pipeline.queue": ("pipeline.producers", "pipeline.consumers", "pipeline.sync", "pipeline.launch",
                           "pipeline.cli", "pipeline.observe"),
        "pipeline.sync": ("pipeline.producers", "pipeline.consumers", "pipeline.launch", "pipeline.cli",
                          "pipeline.observe"),
        "pipeline.producers": ("pipeline.consumers", "pipeline.heldout", "pipeline.launch", "pipeline.cli",
                               "pipeline.observe"),
        "pipeline.consumers": ("pipeline.producers", "pipeline.heldout", "pipeline.launch", "pipeline.cli",
                               "pipeline.observe"),
        # Held-out evaluation may use both stages, but nothing above it.
        "pipeline.heldout": ("pipeline.launch", "pipeline.cli", "pipeline.observe"),
        # Prompt data and model specs sit below every stage that reads them.
        "pipeline.data": STAGES,
        "pipeline.models": tuple(s for s in STAGES if s != "pipeline.models"),
        "pipeline.config": STAGES + ("pipeline.rundir",),
        # The run folder's layout sits below every stage: any of them, the queue included, may import it.
        "pipeline.rundir": STAGES,
    }
    wrong = []
    for module, imports in import_graph().items():
        for stage, forbidden in above.items():
            if module == stage or module.startswith(stage + "."):
                wrong += [f"{module} imports {m}" for m in sorted(imports) if m.startswith(forbidden)]
    assert not wrong, "\n".join(wrong)


def test_rundir_imports_only_the_recipe_schema_and_errors_even_when_deferred() -> None:
    """``pipeline.rundir`` is importable from anywhere: besides the standard library it reaches for
    ``pipeline.errors`` and ``pipeline.config`` only, at module level or inside a function."""
    tree = ast.parse((PACKAGE / "rundir.py").read_text())
    names = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    names += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    wrong = [n for n in names if n.startswith("pipeline") and n.partition(".")[2].partition(".")[0]
             not in ("errors", "config")]
    wrong += [n for n in names if not n.startswith("pipeline") and n.partition(".")[0] not in _stdlib()]
    assert names and not wrong, wrong


def _stdlib() -> frozenset[str]:
    import sys

    return frozenset(sys.stdlib_module_names) | {"__future__"}
