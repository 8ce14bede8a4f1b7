"""sonic/data is a line, not a circle: each module imports only modules of its own stage or an earlier one,
and no import (at module level or inside a function) closes a cycle."""
import ast
from pathlib import Path

import sonic.data

DATA = Path(sonic.data.__file__).parent
# sources, then tokenizer, then packing, then shards, then loader (sonic/data/__init__.py says what each holds)
STAGES = {
    "sources": ["cache", "local_text", "make_corpus", "documents"],
    "tokenizer": ["local_bpe", "tokenizer", "config"],
    "packing": ["corpus", "packing", "plan", "streaming"],
    "shards": ["shards", "prepare", "build_local"],
    "loader": ["loader", "__init__"],
}
STAGE_OF = {module: i for i, modules in enumerate(STAGES.values()) for module in modules}


def data_imports(path: Path) -> set[str]:
    """The sonic.data modules that a file imports, wherever the import statement stands; a name taken
    from the package itself (`from sonic.data import DataConfig`) imports its __init__."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == "sonic.data":
            modules = [f"sonic.data.{a.name if a.name in STAGE_OF else '__init__'}" for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[:2] == ["sonic", "data"]:
                found.add(parts[2] if len(parts) > 2 else "__init__")
    return found - {path.stem}


def graph() -> dict[str, set[str]]:
    return {path.stem: data_imports(path) for path in sorted(DATA.glob("*.py"))}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_every_module_has_a_stage():
    assert set(graph()) == set(STAGE_OF), "add the new module to STAGES, where it belongs in the line"


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, " -> ".join(cycle)


def test_imports_point_back_along_the_line():
    names = list(STAGES)
    wrong = [f"{m} ({names[STAGE_OF[m]]}) imports {d} ({names[STAGE_OF[d]]})"
             for m, deps in graph().items() for d in sorted(deps) if STAGE_OF[d] > STAGE_OF[m]]
    assert not wrong, wrong


def test_the_checker_sees_function_level_imports_and_cycles(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from sonic.data import DataConfig, cache\n\n"
                      "def f():\n    from sonic.data.loader import build_loaders\n")
    assert data_imports(source) == {"__init__", "cache", "loader"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
