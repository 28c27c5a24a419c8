"""Where code asks which model family a model is, or which compute mode a setting names, by comparing
with the name (tests/unit/test_package_shape.py on this checkout, tests/unit/test_extension_points.py on
a copy with one more of each). A family's behaviour lives in its folder (ugpum/arch/<family>/), a mode's
in its file (ugpum/compute/modes/<mode>.py): elsewhere the code asks the spec or the mode instead."""
from __future__ import annotations

import ast
from pathlib import Path

# The timestep method "flux2" and the sampler schedule "flux2" are settings users type, named after FLUX.2
# but not a family: compared as `method` or `schedule`.
SETTINGS_NAMED_LIKE_A_FAMILY = {"method", "schedule"}
# bf16 and fp8 are weight dtypes too: compared as one of these settings, or keyed in a table of weight
# dtypes, they mean the dtype.
WEIGHT_DTYPE_SETTINGS = {"held_dtype", "weight_dtype", "stored_dtype", "default_dtype", "dtype", "stored"}
WEIGHT_DTYPES = {"bf16", "fp16", "fp8", "fp32"}


def _named(node: ast.AST) -> str | None:
    """The name of a variable or attribute (`family` of `spec.family`), else None."""
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if isinstance(node, ast.Attribute) else None


def _strings(node: ast.AST) -> set[str]:
    """The string literals of a string, or of a tuple, list or set of literals."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)}


def branches_on(path: Path, names: set[str], label: str, called: str | None = None,
                settings_like: set[str] = frozenset(), keys: set[str] | None = None) -> list[str]:
    """Where `path` asks which of `names` (families, compute modes) a value is: a comparison (==, !=, in,
    not in) of one of them with a value not named in `settings_like` (other settings spelled like one of
    `names`), or of anything `called` so with any string; a dict literal keyed by one of `keys` (default
    `names`); a match case for one of `names`."""
    keys = names if keys is None else keys
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            for op, a, b in zip(node.ops, sides, sides[1:]):
                if not isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)):
                    continue
                for x, y in ((a, b), (b, a)):
                    if (called and _named(x) == called and _strings(y)) or \
                            (_strings(x) & names and _named(y) not in settings_like):
                        found.append(f"{path.name}:{node.lineno} compares a {label}")
                        break
        elif isinstance(node, ast.Dict) and keys & {k.value for k in node.keys if isinstance(k, ast.Constant)}:
            found.append(f"{path.name}:{node.lineno} a dict keyed by {label}")
        elif isinstance(node, ast.MatchValue) and isinstance(node.value, ast.Constant) and node.value.value in names:
            found.append(f"{path.name}:{node.lineno} a case for a {label}")
    return sorted(set(found), key=lambda f: int(f.split(":")[1].split()[0]))


def family_branches(path: Path, families: set[str]) -> list[str]:
    return branches_on(path, families, "family", "family", SETTINGS_NAMED_LIKE_A_FAMILY)


def mode_branches(path: Path, modes: set[str]) -> list[str]:
    return branches_on(path, modes, "compute mode", settings_like=WEIGHT_DTYPE_SETTINGS, keys=modes - WEIGHT_DTYPES)


def pack_code(root: Path) -> list[Path]:
    """The pack's Python code at `root`: the core, the nodes, the bridge to ComfyUI and the scripts (bench/
    aside: it is being rewritten to drive the engine)."""
    return sorted((root / "ugpum").rglob("*.py")) + sorted((root / "nodes").rglob("*.py")) + \
        [root / "comfy_bridge.py"] + sorted((root / "scripts").glob("*.py"))


def name_branches(root: Path, families: set[str], modes: set[str]) -> list[str]:
    """Every place in the pack at `root` outside a family's or a mode's own folder that compares with one
    of their names."""
    arch, modes_folder = root / "ugpum" / "arch", root / "ugpum" / "compute" / "modes"
    return [f for p in pack_code(root) if not p.is_relative_to(arch) for f in family_branches(p, families)] + \
        [f for p in pack_code(root) if not p.is_relative_to(modes_folder) for f in mode_branches(p, modes)]
