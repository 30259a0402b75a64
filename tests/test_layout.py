"""The package's shape, read from the code: edgechat's import graph (every import, those inside
functions and TYPE_CHECKING blocks too) has no circle; the engine's sub-packages never import its
top level (the `Engine` front: core, pool, embeddings, the package itself); models/ (the catalog
and the memory planner) imports nothing of the engine; the server's translators only translate
(what every API shares is set in server/rules.py); the step loop's functions and classes stay
short enough to read whole."""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

import edgechat
from edgechat.engine.schedule.running import Running

PACKAGE = Path(edgechat.__file__).parent
ENGINE = "edgechat.engine"


def _name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Each edgechat module -> the edgechat modules it imports (`from a import b` counts as a.b
    where a.b is a module, else as a)."""
    files = {_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:
                    base = package.split(".")
                    module = ".".join(base[: len(base) - node.level + 1] + ([module] if module else []))
                for alias in node.names:
                    if f"{module}.{alias.name}" in files:
                        found.add(f"{module}.{alias.name}")
                    elif module in files:
                        found.add(module)
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names if alias.name in files}
        graph[name] = found - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            part = []
            while True:
                top = stack.pop()
                part.append(top)
                if top == node:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_import_graph_has_no_circle():
    assert circles(import_graph()) == []


def _engine_top_level() -> set[str]:
    return {ENGINE} | {f"{ENGINE}.{path.stem}" for path in (PACKAGE / "engine").glob("*.py") if path.stem != "__init__"}


def test_the_engine_has_sub_packages_and_none_imports_its_top_level():
    graph = import_graph()
    top = _engine_top_level()
    subpackages = {path.parent.name for path in (PACKAGE / "engine").glob("*/__init__.py")}
    assert {"kv", "runners", "output", "schedule", "prompt"} <= subpackages
    upward = sorted(f"{module} -> {target}" for module, targets in graph.items()
                    if module.startswith(ENGINE + ".") and module not in top for target in targets & top)
    assert upward == []


def test_models_imports_nothing_of_the_engine():
    graph = import_graph()
    upward = sorted(f"{module} -> {target}" for module, targets in graph.items() if module.startswith("edgechat.models")
                    for target in targets if target == ENGINE or target.startswith(ENGINE + "."))
    assert upward == []


def test_only_the_servers_rules_set_what_every_api_shares():
    """The tool grammar for the model's family and the reasoning split are set once, by the
    dispatcher's rules after translation: no translator builds a tool grammar or sets the split."""
    setters = set()
    for path in sorted((PACKAGE / "server").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module == "edgechat.engine.output.tools":
                setters |= {f"{path.stem} imports tool_grammar" for alias in node.names if alias.name == "tool_grammar"}
            elif isinstance(node, ast.keyword) and node.arg == "split_reasoning" or \
                    isinstance(node, ast.Attribute) and node.attr == "split_reasoning":
                setters.add(f"{path.stem} sets split_reasoning")
    assert setters == {"rules imports tool_grammar", "rules sets split_reasoning"}


#: the step loop's packages, kept to parts a newcomer can read whole: the scheduler and what it
#: hands work to (engine/schedule), and what turns tokens into a request's answer (engine/output)
STEP_LOOP = sorted((PACKAGE / "engine" / "schedule").glob("*.py")) + sorted((PACKAGE / "engine" / "output").glob("*.py"))
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 400
MAX_RUNNING_FIELDS = 14


def test_the_step_loop_has_no_long_function_or_class():
    long = []
    for path in STEP_LOOP:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
                assert node.end_lineno is not None
                if node.end_lineno - node.lineno + 1 > limit:
                    long.append(f"{_name(path)}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert long == []


def test_a_running_request_holds_few_fields():
    assert len(fields(Running)) <= MAX_RUNNING_FIELDS


RUNNERS = f"{ENGINE}.runners"


def _imported_names(path: Path) -> set[str]:
    """Every module a file imports, by its full name (inside functions too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
    return names


def test_llama_cpps_runner_modules_each_hold_one_job_and_import_downward():
    # the library (init, log), then the vocabulary, then the runner over a context; pooling
    # and libmtmd build on the runner, never the other way round
    graph = import_graph()
    below = {
        "llamacpp": set(),
        "vocab": {"llamacpp"},
        "llama": {"llamacpp", "vocab", "runner"},
        "pooling": {"llamacpp", "llama"},
        "mtmd": {"llamacpp", "llama"},
    }
    for module, allowed in below.items():
        runners = {t.rpartition(".")[2] for t in graph[f"{RUNNERS}.{module}"] if t.startswith(RUNNERS + ".")}
        assert runners <= allowed, f"runners/{module}.py imports {sorted(runners - allowed)}"
    # libmtmd's bindings load its shared library: one module asks for them
    users = sorted(path.name for path in (PACKAGE / "engine" / "runners").glob("*.py")
                   if "llama_cpp.mtmd_cpp" in _imported_names(path))
    assert users == ["mtmd.py"]


def test_the_chat_screens_parts_are_objects_that_call_each_other_publicly():
    # each part is an object the screen holds (not a Screen class the screen inherits), and one
    # reaches another's members only where they are public: no stubs standing for them
    chat = PACKAGE / "tui" / "chat"
    for path in [*sorted(chat.glob("*.py")), PACKAGE / "tui" / "screens" / "chat.py"]:
        tree = ast.parse(path.read_text(), str(path))
        for cls in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)):
            if cls.name.endswith("Part"):
                assert not cls.bases, f"{path.name}: {cls.name} extends {ast.unparse(cls.bases[0])}"
            stubs = [f.name for block in cls.body if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
                     for f in block.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)]
            assert stubs == [], f"{path.name}: {cls.name} declares {stubs} for type checking only"
        reached = sorted(f"{ast.unparse(node)} (line {node.lineno})" for node in ast.walk(tree)
                         if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                         and isinstance(node.value, ast.Attribute) and ast.unparse(node.value).startswith("self."))
        assert reached == [], f"{path.name} reaches private members of another object: {reached}"


def test_every_action_is_run_by_one_part_of_the_chat_screen():
    from edgechat.tui.actions import ACTIONS
    from edgechat.tui.screens.chat import RUNS, ChatScreen

    routed = [name for names in RUNS.values() for name in names]
    assert sorted(routed) == sorted(a.name for a in ACTIONS)
    screen = ChatScreen()
    missing = [f"{part}.{name}" for part, names in RUNS.items() for name in names
               if not callable(getattr(getattr(screen, part), name, None))]
    assert missing == []
