"""The package's shape, as DESIGN §2 and §8 ask: the core never reaches up to ComfyUI, nothing in
`ugpum` imports in a circle (lazy imports inside functions count too), the nodes load no verbs, and
the tests use what a user of the library uses (no bench scripts, no private names)."""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from support.name_branches import family_branches, mode_branches, name_branches

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


# ugpum's layers, lowest first: a module may import its own layer and the ones below, never above. Every
# package and top-level module is in exactly one (`test_every_part_of_ugpum_is_in_one_layer`).
LAYERS = (
    # foundations: how a message names a setting, folders the user chose, stops while starting, file formats
    ("ugpum.wording", "ugpum.folders", "ugpum.startup", "ugpum.formats"),
    # mechanisms: how a block computes, the flow-matching math, where weights live and how activations move
    ("ugpum.compute", "ugpum.diffusion", "ugpum.placement"),
    # the models: each family's folder, and the files and profiles known by name
    ("ugpum.arch", "ugpum.catalog"),
    # what the engine decides before loading (the plan) and shows (pictures)
    ("ugpum.planning", "ugpum.render"),
    ("ugpum.train",),                   # the one training loop and its parts
    ("ugpum.distributed",),             # the torchrun engine: a stepper the same loop drives
    ("ugpum.commands",),                # the command-line verbs, over everything
)
TOP_LEVEL_MODULES_AT_MOST = 12          # ugpum/*.py, __init__ and __main__ included


def layer_of(module: str) -> int | None:
    if module in ("ugpum", "ugpum.__main__"):
        return len(LAYERS)                  # the public face and the entry point stand over every layer
    for i, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a lower layer into a higher one (the public face `ugpum/__init__.py` and the
    entry point `__main__.py` may import anything)."""
    return sorted(f"{a} -> {b}" for a, targets in graph.items() if a not in ("ugpum", "ugpum.__main__")
                  for b in targets if layer_of(b) > layer_of(a))


def test_every_part_of_ugpum_is_in_one_layer_and_the_top_level_is_small():
    parts = {name.split(".")[1] for name in ugpum_graph() if name.count(".") >= 1} - {"__main__"}
    assert sorted(p for p in parts if layer_of(f"ugpum.{p}") is None) == []
    top_level = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top_level) <= TOP_LEVEL_MODULES_AT_MOST, top_level


def test_upward_imports_are_found_and_ugpum_has_none():
    assert upward_imports({"ugpum.planning.plan": {"ugpum.train.config"}, "ugpum.train.loop": {"ugpum.planning.plan"},
                           "ugpum.compute.lora": {"ugpum.arch.base"}, "ugpum.arch.base": {"ugpum.compute.lora"}}) == \
        ["ugpum.compute.lora -> ugpum.arch.base", "ugpum.planning.plan -> ugpum.train.config"]
    assert upward_imports(ugpum_graph()) == []


def long_or_wide_functions(path: Path, max_lines: int = 80, max_params: int = 12) -> list[str]:
    """Functions of `path` over `max_lines` lines (docstring included) or taking more than
    `max_params` parameters (self and cls not counted; nor a Triton kernel's, which are its launch ABI: each
    pointer, size and tile constant a parameter of its own)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            params = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg not in ("self", "cls")]
            params += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
            lines = node.end_lineno - node.lineno + 1
            kernel = any("jit" in ast.unparse(d) for d in node.decorator_list)
            if lines > max_lines or (len(params) > max_params and not kernel):
                found.append(f"{path.name}:{node.lineno} {node.name} ({lines} lines, "
                             f"{len(params)} parameters)")
    return found


def test_functions_are_short_and_take_few_parameters(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def wide(" + ", ".join(f"a{i}" for i in range(13)) + "):\n    pass\n\n\n"
                      "def long(self):\n" + "    x = 1\n" * 80 + "\n\ndef fine(self, a, b):\n    pass\n\n\n"
                      "@triton.jit\ndef kernel(" + ", ".join(f"a{i}" for i in range(13)) + "):\n    pass\n")
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


# The run folder is one component: only ugpum/train/run/layout.py names what a run folder holds.
RUN_FOLDER_NAMES = {"metrics.jsonl", "plan.json", "checkpoints", "samples", "cache", ".ugpum_run.lock",
                    "before_after.png"}


def run_paths_built(source: str) -> list[str]:
    """`path / "checkpoints"` and the like in `source`: a run folder's layout spelled outside its module."""
    return [f"line {node.lineno}: {node.right.value}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)
            and isinstance(node.right, ast.Constant) and node.right.value in RUN_FOLDER_NAMES]


def test_only_the_run_layout_names_a_run_folders_files():
    assert run_paths_built('from pathlib import Path\nout = Path("x")\np = out / "metrics.jsonl"\n') == \
        ["line 3: metrics.jsonl"]
    offenders = [f"{p.relative_to(REPO)} {f}" for folder in (PACKAGE, REPO / "nodes") for p in sorted(folder.rglob("*.py"))
                 if p != PACKAGE / "train" / "run" / "layout.py" for f in run_paths_built(p.read_text(encoding="utf-8"))]
    assert offenders == []


# A model family's behaviour lives in its folder, a compute mode's in its file: elsewhere the code asks the spec
# or the mode, never which one it is (the checks: tests/support/name_branches.py).
def test_no_code_outside_arch_asks_which_family_a_model_is(tmp_path):
    from ugpum.arch import FAMILIES
    families = {f.name for f in FAMILIES}
    assert families >= {"flux2", "wan"}
    sample = tmp_path / "sample.py"
    sample.write_text("\n".join([
        'if spec.family == "wan": pass',                                  # 1: anything called family
        'padded = pad(c) if "flux2" != kind else c',                      # 2: a family's name
        'video = family in ("wan",)',                                     # 3
        'STAGES = {"flux2": 1, "wan": 2}',                                # 4
        'match name:',
        '    case "wan": pass',                                           # 6
        'fine = method in ("flux2", "flux2_shift") or schedule == "flux2"',   # the settings named after FLUX.2
        'fine = spec.family + "/" + spec.id, family_named(spec.family).calibration, spec.takes_clips',
    ]) + "\n")
    assert family_branches(sample, families) == ["sample.py:1 compares a family", "sample.py:2 compares a family",
                                                 "sample.py:3 compares a family", "sample.py:4 a dict keyed by family",
                                                 "sample.py:6 a case for a family"]
    assert name_branches(REPO, families, set()) == []


def test_no_code_outside_the_modes_folder_asks_which_compute_mode_a_setting_is(tmp_path):
    from ugpum.compute.modes import NAMES
    modes = set(NAMES)
    assert modes >= {"bf16", "fp8", "int8"}
    sample = tmp_path / "sample.py"
    sample.write_text("\n".join([
        'if plan.base_compute == "bf16": pass',                           # 1
        'eight_bit = mode in ("fp8", "int8")',                            # 2
        'SPEED = {"bf16": 1.0, "int8": 0.9}',                             # 3
        'match w.base_compute:',
        '    case "fp8": pass',                                           # 5
        'fine = w.held_dtype != "fp8" or weight_dtype == "bf16" or setting == "auto"',
        'fine = {"bf16": 2, "fp8": 1}, mode_named(w.base_compute).quantises',
    ]) + "\n")
    assert mode_branches(sample, modes) == ["sample.py:1 compares a compute mode",
                                            "sample.py:2 compares a compute mode",
                                            "sample.py:3 a dict keyed by compute mode",
                                            "sample.py:5 a case for a compute mode"]
    assert name_branches(REPO, set(), modes) == []


def test_each_compute_mode_is_one_file_the_registry_finds():
    from ugpum.compute.modes import EXACT, MODES, SETTINGS, mode_named
    from ugpum.compute.modes.mode import ComputeMode
    folder = PACKAGE / "compute" / "modes"
    files = sorted(p.stem for p in folder.glob("*.py") if re.search(r"^MODE = ", p.read_text(encoding="utf-8"), re.M))
    assert sorted(m.name for m in MODES) == files and {"bf16", "fp8", "int8"} <= set(files)
    assert SETTINGS == ("auto", *(m.name for m in MODES)) and [m for m in MODES if not m.quantises] == [EXACT]
    for mode in MODES:
        assert isinstance(mode, ComputeMode) and type(mode).__module__ == f"ugpum.compute.modes.{mode.name}"
        assert mode_named(mode.name) is mode and set(mode.dense_speed) == {"compiled", "eager"}
        assert not mode.quantises or (mode.quality and type(mode).matmul is not ComputeMode.matmul)


def test_each_family_is_one_folder_the_registry_finds_with_every_member_the_code_asks_for():
    import inspect
    from ugpum.arch import FAMILIES, get_spec, model_ids
    from ugpum.arch.base import ArchSpec
    from ugpum.arch.stage import Stage
    from ugpum.diffusion.flow import TIMESTEP_METHODS
    folders = sorted(p.name for p in (PACKAGE / "arch").iterdir() if (p / "__init__.py").is_file())
    assert [f.name for f in FAMILIES] == folders == sorted(folders) and "flux2" in folders and "wan" in folders
    assert len(model_ids()) == len(set(model_ids()))                        # no id claimed by two families
    asked = {name for name, member in vars(ArchSpec).items() if getattr(member, "__isabstractmethod__", False)}
    assert {"takes_clips", "frames_per_latent", "model_context", "sampler_model_fn", "stage_class",
            "attention_flops"} <= asked
    for fam in FAMILIES:
        own = f"ugpum.arch.{fam.name}."
        cls = fam.spec_class
        assert issubclass(cls, ArchSpec) and not inspect.isabstract(cls), (fam.name, cls.__abstractmethods__)
        assert all(getattr(cls, name).__module__.startswith(own) for name in asked
                   if callable(getattr(cls, name)) and not isinstance(getattr(cls, name), type)), fam.name
        assert cls.__module__.startswith(own) and cls.stage_class.__module__.startswith(own)
        assert issubclass(cls.stage_class, Stage) and cls.stage_class.every_stage_modules
        assert cls.default_timesteps in TIMESTEP_METHODS and isinstance(cls.takes_clips, bool)
        assert fam.ids and all(type(get_spec(i)) is cls and get_spec(i).family == fam.name for i in fam.ids)
        assert fam.recognise({}, "") is None
        assert fam.comfy.module.startswith("comfy.") and fam.comfy.kwargs.__module__.startswith(own)
        assert {"memory", "allocator", "efficiency", "host_gib"} <= set(fam.calibration)


# A command-line flag, as a message would spell it: `--resume`, `--base-compute` (not `x--y`, `---`, `--1`).
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z-]+")


def flags_spelled(path: Path) -> list[str]:
    """The string constants of `path` (f-strings' literal parts too, docstrings not) that spell a
    command-line flag, as 'file:line --flag'."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    documented = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree) if isinstance(node, documented) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    strings = sorted((node for node in ast.walk(tree) if isinstance(node, ast.Constant)
                      and isinstance(node.value, str) and id(node) not in docstrings), key=lambda n: n.lineno)
    return [f"{path.name}:{node.lineno} {FLAG.search(node.value).group()}" for node in strings
            if FLAG.search(node.value)]


def test_the_core_spells_no_command_line_flag(tmp_path):
    """The engine marks the setting a message means (ugpum/wording.py) and each front end words it: a
    flag only on the command line, an input on the nodes. So flags are spelled only by the verbs
    (ugpum/commands/), the torchrun-only distributed engine, and wording.py's table of what the marks become."""
    sample = tmp_path / "sample.py"
    sample.write_text('"""Run it with --steps 5."""\n\n\ndef f(out):\n    """Or --resume."""\n'
                      '    return f"continue with --resume {out}"\n\n\n'
                      'NOT_FLAGS = ("x--y", "-- ", "--1", "a ---", "-" * 2)\nHINT = "pass --base-compute fp8"\n')
    assert flags_spelled(sample) == ["sample.py:6 --resume", "sample.py:10 --base-compute"]
    offenders = [f for p in sorted(PACKAGE.rglob("*.py")) if p.relative_to(PACKAGE).parts[0] not in
                 ("commands", "distributed", "wording.py") for f in flags_spelled(p)]
    assert offenders == []


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


# How a run stopped is one value (`ugpum.train.stopping.Stop`) raised with its exception and read back through
# that class: no flag of our own is put on an exception or read off one (tests/support/error_attributes.py).
def test_no_code_puts_its_own_attributes_on_an_exception_but_the_stop_value():
    from support.error_attributes import error_attributes, error_classes
    sample = ast.parse("\n".join([
        "class Halt(KeyboardInterrupt):",
        "    told = True",                                              # 2: a class-level flag
        "    def __init__(self, signum):",
        "        self.signum = signum",                                 # (its own field: fine)
        "def f(err: OSError):",
        "    try:",
        "        pass",
        "    except Exception as stop:",
        "        stop.told = True",                                     # 9
        "        if getattr(stop, 'told', False) or getattr(stop, 'errno', None):",   # 10: 'told' only
        "            raise",
        "    held = Halt(2) if err else KeyboardInterrupt()",
        "    held.after_save, x = True, 1",                             # 13
        "    setattr(err, 'save_step', 3)",                             # 14
        "    return getattr(err, 'filename2', None)",                   # (a standard field: fine)
        "class Stop:",
        "    def throw(self, why: BaseException):",
        "        setattr(why, 'stop', self)",                           # (the stop value itself: fine)
        "other = 1",
        "other.told = True",                                            # (not an exception)
    ]))
    errors = error_classes([sample])
    assert {"Halt", "OSError", "KeyboardInterrupt"} <= errors
    assert [f.split(":")[0] for f in error_attributes(sample, errors, exempt="Stop")] == \
        ["line 2", "line 9", "line 10", "line 13", "line 14"]
    files = {p: ast.parse(p.read_text(encoding="utf-8")) for folder in (PACKAGE, REPO / "nodes")
             for p in sorted(folder.rglob("*.py"))}
    errors = error_classes(list(files.values()))
    stop_module = PACKAGE / "train" / "stopping.py"
    offenders = [f"{p.relative_to(REPO)} {f}" for p, tree in files.items()
                 for f in error_attributes(tree, errors, exempt="Stop" if p == stop_module else None)]
    assert offenders == []
