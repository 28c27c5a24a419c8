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


def stepper_reads(source: str) -> set[str]:
    """The members a module reads of its stepper: `stepper.<name>` and `self.stepper.<name>`."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            held = node.value
            if (isinstance(held, ast.Name) and held.id == "stepper") or \
                    (isinstance(held, ast.Attribute) and held.attr == "stepper"):
                found.add(node.attr)
    return found


def contract_members(protocol) -> dict[str, tuple[str, ...] | None]:
    """A Protocol's members: a method's parameter names (self left out), None for an attribute."""
    import inspect
    members: dict[str, tuple[str, ...] | None] = {name: None for name in protocol.__annotations__}
    for name, value in vars(protocol).items():
        if inspect.isfunction(value) and not name.startswith("_"):
            members[name] = tuple(inspect.signature(value).parameters)[1:]
    return members


def set_on_self(cls) -> set[str]:
    """The attributes a class sets on its instances (`self.x = ...`, `self.x, self.y = ...` in any method)."""
    import inspect
    import textwrap
    found = set()
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(cls)))):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    found.add(t.attr)
    return found


def contract_breaches(cls, protocol) -> list[str]:
    """The members of `protocol` that `cls` lacks, and its methods whose parameters are named otherwise."""
    import inspect
    breaches = []
    for name, params in contract_members(protocol).items():
        own = getattr(cls, name, None)
        if params is None:
            if own is None and name not in set_on_self(cls):
                breaches.append(f"{cls.__name__} lacks {name}")
        elif not inspect.isfunction(own):
            breaches.append(f"{cls.__name__} lacks the method {name}")
        elif tuple(inspect.signature(own).parameters)[1:] != params:
            got = ", ".join(tuple(inspect.signature(own).parameters)[1:])
            breaches.append(f"{cls.__name__}.{name}({got}) differs from {protocol.__name__}.{name}({', '.join(params)})")
    return breaches


def test_the_contract_check_finds_what_a_stepper_lacks_or_names_otherwise():
    from typing import Protocol

    class Contract(Protocol):
        lead: bool
        name: str

        def agree(self, step: int, loss: float, due: bool) -> tuple:
            """(made up)"""

    class MadeUp:
        name = "made up"

        def __init__(self):
            self.ready = True

        def agree(self, loss, due):
            return loss, due

    assert stepper_reads("stepper.agree(1)\nself.stepper.lead\nother.name\n") == {"agree", "lead"}
    assert contract_members(Contract) == {"lead": None, "name": None, "agree": ("step", "loss", "due")}
    assert set_on_self(MadeUp) == {"ready"}
    assert contract_breaches(MadeUp, Contract) == [
        "MadeUp lacks lead", "MadeUp.agree(loss, due) differs from Contract.agree(step, loss, due)"]


def test_the_loop_uses_exactly_the_engines_contract_and_both_steppers_keep_it():
    """ugpum/train/engine.py's Stepper is what the loop reads of its stepper, no more, no less, and
    both steppers (one process; one rank of torchrun, importable on the CPU) keep it."""
    from ugpum.distributed.stepper import TorchrunRankStepper
    from ugpum.train.engine import Stepper
    from ugpum.train.stepper import OneProcessStepper
    used = stepper_reads((PACKAGE / "train" / "loop.py").read_text(encoding="utf-8"))
    contract = contract_members(Stepper)
    assert sorted(used - set(contract)) == [], "the loop uses members the contract does not name"
    assert sorted(set(contract) - used) == [], "the contract names members the loop does not use"
    for stepper in (OneProcessStepper, TorchrunRankStepper):
        assert contract_breaches(stepper, Stepper) == []
