"""The package's shape, as DESIGN §2 and §8 ask: the core never reaches up to ComfyUI, nothing in
`ugpum` imports in a circle (lazy imports inside functions count too), the nodes load no verbs, and
the tests use what a user of the library uses (no bench scripts, no private names)."""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "ugpum"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports (absolute names), at module level or inside functions."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)   # `from . import x` names a module
    return found


def ugpum_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in imported_modules(path) if m in modules and m != name}
            for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports between modules, ignoring a package's own __init__ importing its children
    (that is how a package shows its public face, not a circle)."""
    def edges(a):
        return {b for b in graph[a] if not (a.startswith(b + ".") and b in graph)}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(a):
        state[a] = 1
        stack.append(a)
        for b in sorted(edges(a)):
            if state.get(b) == 1:
                return stack[stack.index(b):] + [b]
            if b not in state:
                found = visit(b)
                if found:
                    return found
        stack.pop()
        state[a] = 2
        return None
    for a in sorted(graph):
        if a not in state:
            found = visit(a)
            if found:
                return found
    return None


def test_find_cycle_finds_a_circle_and_passes_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circle_in_ugpum():
    graph = ugpum_graph()
    assert "ugpum.train.loop" in graph["ugpum.commands.train"]        # imported inside a function: seen too
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


# ugpum's layers, lowest first: a module may import its own layer and the ones below, never above.
# The core (top-level modules and the arch, formats and diffusion packages), then the training
# engine, the distributed engine on top of it, and the command-line verbs over everything.
LAYERS = ("core", "ugpum.train", "ugpum.distributed", "ugpum.commands")


def layer_of(module: str) -> int:
    for i, prefix in reversed(list(enumerate(LAYERS))):
        if module == prefix or module.startswith(prefix + "."):
            return i
    return 0


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a lower layer into a higher one (the public face `ugpum/__init__.py` and the
    entry point `__main__.py` may import anything)."""
    return sorted(f"{a} -> {b}" for a, targets in graph.items() if a not in ("ugpum", "ugpum.__main__")
                  for b in targets if layer_of(b) > layer_of(a))


def test_upward_imports_are_found_and_ugpum_has_none():
    assert upward_imports({"ugpum.plan": {"ugpum.train.config"}, "ugpum.train.loop": {"ugpum.plan"}}) == \
        ["ugpum.plan -> ugpum.train.config"]
    assert upward_imports(ugpum_graph()) == []


def long_or_wide_functions(path: Path, max_lines: int = 80, max_params: int = 12) -> list[str]:
    """Functions of `path` over `max_lines` lines (docstring included) or taking more than
    `max_params` parameters (self and cls not counted)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            params = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg not in ("self", "cls")]
            params += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
            lines = node.end_lineno - node.lineno + 1
            if lines > max_lines or len(params) > max_params:
                found.append(f"{path.name}:{node.lineno} {node.name} ({lines} lines, "
                             f"{len(params)} parameters)")
    return found


def test_functions_are_short_and_take_few_parameters(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def wide(" + ", ".join(f"a{i}" for i in range(13)) + "):\n    pass\n\n\n"
                      "def long(self):\n" + "    x = 1\n" * 80 + "\n\ndef fine(self, a, b):\n    pass\n")
    assert [f.split()[1] for f in long_or_wide_functions(sample)] == ["wide", "long"]
    offenders = [f for p in sorted(PACKAGE.rglob("*.py")) for f in long_or_wide_functions(p)]
    assert offenders == []


def test_only_the_verbs_reach_comfyui():
    pattern = re.compile(r"comfy_bridge|^\s*import comfy|^\s*from comfy", re.M)
    offenders = [str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py")
                 if pattern.search(p.read_text(encoding="utf-8")) and "commands" not in p.parts]
    assert offenders == []
    assert pattern.search((PACKAGE / "commands" / "bridge.py").read_text())       # the check can match


def test_nodes_load_no_verbs():
    for path in (REPO / "nodes").glob("*.py"):
        assert not any(m.startswith("ugpum.commands") for m in imported_modules(path)), path.name


def test_tests_use_the_public_library():
    private = re.compile(r"^\s*from ugpum[\w.]* import [^#\n]*\b_[a-z]\w*", re.M)
    for path in (REPO / "tests").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        modules = imported_modules(path)
        assert not any(m == "bench" or m.startswith("bench.") for m in modules), f"{path.name} imports a bench script"
        assert not private.search(text), f"{path.name} imports a private name of ugpum"


# Settings flow one way: config -> plan -> engine. What the plan resolves (`auto` made concrete) is read
# from the plan; writing it back into a config would give one setting two values.
RESOLVED_BY_THE_PLAN = {"base_compute", "devices", "schedule"}


def settings_written_back(source: str) -> list[str]:
    """`replace(config, ...)` calls in `source` that set a setting the plan resolves."""
    def is_config(node):
        return (isinstance(node, ast.Name) and node.id in ("cfg", "config")) or \
            (isinstance(node, ast.Attribute) and node.attr in ("cfg", "config"))
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and node.args and is_config(node.args[0]):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name == "replace":
                found += [f"line {node.lineno}: {k.arg}" for k in node.keywords if k.arg in RESOLVED_BY_THE_PLAN]
    return found


def test_no_setting_flows_back_from_the_plan_into_a_config():
    assert settings_written_back("import dataclasses\ncfg = dataclasses.replace(cfg, base_compute=plan.base_compute)\n"
                                 "c = replace(plan.config, steps=3, schedule=plan.plan.schedule)\n") == \
        ["line 2: base_compute", "line 3: schedule"]
    offenders = [f"{p.relative_to(REPO)} {f}" for folder in (PACKAGE, REPO / "nodes")
                 for p in sorted(folder.rglob("*.py")) for f in settings_written_back(p.read_text(encoding="utf-8"))]
    assert offenders == []


# The run folder is one component: only ugpum/train/run_layout.py names what a run folder holds.
RUN_FOLDER_NAMES = {"metrics.jsonl", "plan.json", "checkpoints", "samples", "cache", ".ugpum_run.lock",
                    "before_after.png"}


def run_paths_built(source: str) -> list[str]:
    """`path / "checkpoints"` and the like in `source`: a run folder's layout spelled outside run_layout."""
    return [f"line {node.lineno}: {node.right.value}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)
            and isinstance(node.right, ast.Constant) and node.right.value in RUN_FOLDER_NAMES]


def test_only_the_run_layout_names_a_run_folders_files():
    assert run_paths_built('from pathlib import Path\nout = Path("x")\np = out / "metrics.jsonl"\n') == \
        ["line 3: metrics.jsonl"]
    offenders = [f"{p.relative_to(REPO)} {f}" for folder in (PACKAGE, REPO / "nodes") for p in sorted(folder.rglob("*.py"))
                 if p.name != "run_layout.py" for f in run_paths_built(p.read_text(encoding="utf-8"))]
    assert offenders == []
