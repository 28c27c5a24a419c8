"""Where code puts an attribute of its own on an exception, or reads one off it (tests/unit/test_package_shape.py).
How a run stopped travels as one value, `ugpum.train.stopping.Stop`, raised with its exception and read back
through that class; nothing else steers a stop by flags on exceptions (`err.told = True`, `getattr(err,
"told", False)`). Reading a field that Python's own exceptions define (`errno`, `filename`, ...) is fine."""
from __future__ import annotations

import ast
import builtins

BUILTIN_ERRORS = {name for name, value in vars(builtins).items()
                  if isinstance(value, type) and issubclass(value, BaseException)}
# the fields Python's exceptions carry: read with getattr where an error may be of another kind
STANDARD_FIELDS = {field for name in BUILTIN_ERRORS for field in dir(getattr(builtins, name))}
ATTRIBUTE_CALLS = {"getattr", "hasattr", "setattr", "delattr"}


def _base_name(base: ast.expr) -> str:
    return base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")


def error_classes(trees: list[ast.AST]) -> set[str]:
    """Python's exception classes and those `trees` derive from them (by name)."""
    known = set(BUILTIN_ERRORS)
    classes = [n for tree in trees for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    while True:
        more = {c.name for c in classes if c.name not in known and any(_base_name(b) in known for b in c.bases)}
        if not more:
            return known
        known |= more


def _error_names(scope: ast.AST, errors: set[str]) -> set[str]:
    """The names that hold an exception in `scope`: bound by `except ... as`, raised, made by calling an
    exception class (in either branch of a conditional), or parameters annotated as one."""
    def is_made(value):
        if isinstance(value, ast.IfExp):
            return is_made(value.body) or is_made(value.orelse)
        return isinstance(value, ast.Call) and _base_name(value.func) in errors
    found = set()
    for node in ast.walk(scope):
        if isinstance(node, ast.ExceptHandler) and node.name:
            found.add(node.name)
        elif isinstance(node, ast.Raise) and isinstance(node.exc, ast.Name):
            found.add(node.exc.id)
        elif isinstance(node, ast.Assign) and is_made(node.value):
            found |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.arg) and node.annotation is not None and \
                {n.id for n in ast.walk(node.annotation) if isinstance(n, ast.Name)} & errors:
            found.add(node.arg)
    return found


def _uses(scope: ast.AST, held: set[str]) -> list[ast.AST]:
    """Attributes set on the names `held`, and getattr and the like on them (a standard field read aside)."""
    found = []
    for node in ast.walk(scope):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in held:
                    found.append(t)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ATTRIBUTE_CALLS and node.args \
                and isinstance(node.args[0], ast.Name) and node.args[0].id in held:
            field = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else None
            if node.func.id in ("setattr", "delattr") or field not in STANDARD_FIELDS:
                found.append(node)
    return found


def error_attributes(tree: ast.AST, errors: set[str], exempt: str | None = None) -> list[str]:
    """Lines of `tree` that set an attribute on an exception or read one of its own off it, and class-level
    values of exception classes (`told = True`); the class named `exempt` (the stop value) may."""
    skipped = {id(n) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name == exempt
               for n in ast.walk(c)}
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    top = [n for n in ast.iter_child_nodes(tree) if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                        ast.ClassDef))]
    found = [n for scope in functions + top for n in _uses(scope, _error_names(scope, errors))]
    found += [n for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name in errors
              for n in c.body if isinstance(n, (ast.Assign, ast.AnnAssign))]
    kept = sorted({id(n): n for n in found if id(n) not in skipped}.values(),      # (a nested function is in
                  key=lambda n: n.lineno)                                          # two scopes)
    return [f"line {n.lineno}: {ast.unparse(n).splitlines()[0]}" for n in kept]
