"""Regional compilation: every transformer block's forward compiled once by torch.compile and reused.

What is compiled
----------------
The *class's* forward (``type(block).forward``), wrapped once per class by ``torch.compile`` and bound
to each block. Dynamo keys its cache on the code object and, with ``inline_inbuilt_nn_modules`` (on by
default since torch 2.5), treats a block's parameters as graph inputs rather than constants, so the
32 FLUX.2 klein blocks (two classes) or the 40 Wan blocks (one class) cost two or one compilations per
(grad mode, shape family), not one per block: seconds to a minute, not minutes.

What is inside the graph, what stays outside
---------------------------------------------
* LoRA: ``ugpum.compute.lora`` adds adapters as forward hooks on the Linears inside the blocks. Dynamo
  traces through ``Module.__call__`` of submodules with their hooks (inbuilt-module inlining), so each
  adapter's ``x @ A^T`` and ``addmm`` are in the block's graph and inductor fuses around them. Checked
  by ``compile_stats`` (``graph_breaks`` 0 on ComfyUI's FLUX.2 and Wan blocks in the tests).
* The in-place guard's norm pre-hooks (``ugpum.compute.inplace_guard``) are traced the same way. They are still
  needed: AOT autograd traces the joint graph with autograd's version checks, so compiling a FLUX.2 block
  without them fails.
* The compiled function works on private copies of the block's tensor arguments, taken inside the graph
  (``_forward_on_copies``). A FLUX.2 block adds into its inputs (``img += ...``); compiled as is, AOT
  autograd applies that as a ``copy_`` into the caller's tensor after the graph ran, while its min-cut
  partitioner saved that same input for backward (it recomputes the norm from it rather than keeping the
  guard's copy). The ``copy_`` then bumps the saved tensor's version and backward fails ("modified by an
  inplace operation ... CopyBackwards"): without recompute on every FLUX.2 block, and with it only
  because ``recompute_block`` copies the inputs first. With the copies in the graph nothing is mutated,
  and inductor fuses each copy into the kernels that read it.
* Each block compiles as ONE graph (``fullgraph=True``) or not at all. Where Dynamo would split a block
  (an op it cannot trace: ComfyUI's split attention on the CPU asks psutil for free memory), a later
  piece adds in place into a tensor that an earlier piece saved for backward, and backward fails as
  above; the copies at the entry cannot help there. So a class whose forward does not trace as one
  graph (or runs past the recompile limit) runs eagerly from then on, said in one log line
  (``_ClassForward``); Dynamo raises while tracing, before anything ran, so the call is simply redone.
* Per-block recompute (``ugpum.compute.recompute``) wraps ``block.forward`` *outside* the compiled
  function: compile first, wrap for recompute after (``compile_blocks`` refuses a block whose forward is
  already wrapped). Recomputation in backward re-runs the compiled forward; except where the recompute keeps
  some outputs (selective checkpointing: `Workload.attention_kept`), which torch compiles only with the
  checkpoint inside the graph: the class then has a second compiled function (``recomputed``), whose backward
  graph recomputes what it needs and is fused by inductor with the backward's own work.
* Placement hooks (``ugpum.placement.place``: moving inputs between devices, swap-in) are ``Module.__call__``
  hooks of the block itself; they run before ``forward`` and are never compiled. A block on another
  device, or a swapped block whose weights sit in a different slot, is the same graph with inputs on
  that device: at most one more compilation per device.
* fp8 weights cast by ComfyUI's manual-cast ops and our 8-bit Linears are traced with the block (0 graph
  breaks on the H200 in every mode); a block with an op that cannot be traced runs eagerly (above).

Shapes
------
``dynamic=None`` (torch's default, "automatic dynamic"): the first shape compiles static; the first time
a dimension changes, the block recompiles once with that dimension symbolic and later sizes reuse it.
Buckets therefore cost at most two compilations per class and grad mode. ``recompile_limit`` bounds what
Dynamo may compile per code object (``torch._dynamo.config.recompile_limit``; beyond it the class runs
eagerly, and we log it once); every compilation is counted by our backend and reported by
``compile_stats()``.

Pure torch; nothing here imports ComfyUI.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import shutil
import threading
import types
from dataclasses import dataclass, field

import torch
import torch.utils.checkpoint
from torch import nn

__all__ = ["compile_blocks", "compile_support", "compile_stats", "CompileStats", "SETTINGS"]

SETTINGS = ("auto", "on", "off")
DEFAULT_RECOMPILE_LIMIT = 16


@dataclass
class CompileStats:
    """What compilation has cost so far in this process (all `compile_blocks` calls together)."""
    graphs: int = 0                         # FX graphs handed to inductor (one per compile, per graph piece)
    by_class: dict[str, int] = field(default_factory=dict)
    graph_breaks: int = 0                   # Dynamo's graph-break counter (0: each block is one graph)
    seconds: float = 0.0                    # time spent inside inductor

    def line(self) -> str:
        per = ", ".join(f"{k} {v}" for k, v in sorted(self.by_class.items()))
        return (f"compiled {self.graphs} graph(s) ({per}) in {self.seconds:.1f} s, "
                f"{self.graph_breaks} graph break(s)")


_stats = CompileStats()
_lock = threading.Lock()
_compiled_forwards: dict[tuple[type, object], tuple] = {}     # (class, options) -> (forward on copies, compiled)


def compile_stats() -> CompileStats:
    """A copy of the process-wide counts, with Dynamo's graph-break counter read now."""
    try:
        from torch._dynamo.utils import counters
        breaks = sum(counters["graph_break"].values())
    except Exception:                                            # pragma: no cover - private API moved
        breaks = -1
    with _lock:
        return CompileStats(_stats.graphs, dict(_stats.by_class), breaks, _stats.seconds)


def _counting_backend(label: str):
    """Inductor, counting each graph it compiles (so recompiles are visible and bounded)."""
    def backend(gm, example_inputs):
        import time
        from torch._inductor.compile_fx import compile_fx
        t0 = time.perf_counter()
        out = compile_fx(gm, example_inputs)
        with _lock:
            _stats.graphs += 1
            _stats.by_class[label] = _stats.by_class.get(label, 0) + 1
            _stats.seconds += time.perf_counter() - t0
        return out
    return backend


def _device_types(model: nn.Module, block_paths: list[str]) -> set[torch.device]:
    devices = set()
    for path in block_paths:
        for p in model.get_submodule(path).parameters():
            if p.device.type != "meta":
                devices.add(p.device)
    return devices


def compile_support(devices) -> str | None:
    """None when torch.compile can run on all of `devices` (torch.device or str), else why not: one
    sentence. CUDA needs Triton and compute capability >= 7.0; CPU needs a C++ compiler (inductor's C++
    backend)."""
    devices = [torch.device(d) for d in devices]
    if not hasattr(torch, "compile"):
        return f"torch {torch.__version__} has no torch.compile"
    for d in devices:
        if d.type == "cuda":
            if importlib.util.find_spec("triton") is None:
                return "Triton is not installed (on Windows: pip install triton-windows), so blocks run eagerly"
            major, minor = torch.cuda.get_device_capability(d)
            if major < 7:
                return (f"{torch.cuda.get_device_name(d)} (compute capability {major}.{minor}) is older than "
                        "Triton supports (7.0), so blocks run eagerly")
        elif d.type == "cpu":
            if not any(shutil.which(c) for c in ("g++", "c++", "clang++", "gcc", "cl")):
                return "no C++ compiler for inductor's CPU backend, so blocks run eagerly"
        else:
            return f"torch.compile is not supported here for {d.type} devices, so blocks run eagerly"
    return None


def _set_recompile_limit(limit: int) -> None:
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    if getattr(cfg, name) < limit:
        setattr(cfg, name, limit)
    if hasattr(cfg, "accumulated_recompile_limit") and cfg.accumulated_recompile_limit < 4 * limit:
        cfg.accumulated_recompile_limit = 4 * limit


def compile_blocks(model: nn.Module, block_paths: list[str], setting: str = "auto", log=print, *,
                   dynamic: bool | None = None, recompile_limit: int = DEFAULT_RECOMPILE_LIMIT,
                   mode: str | None = None):
    """Compile each block's forward (regional compilation); returns `undo()` restoring eager forwards.

    setting: 'off' compiles nothing; 'on' compiles on whatever device the blocks are (CPU: inductor's
    C++ backend) and raises if that cannot work; 'auto' compiles on CUDA GPUs that Triton supports and
    otherwise logs ONE line saying why the blocks run eagerly (on CPU, auto means off).
    Call it after the blocks are placed and BEFORE `recompute_blocks` (which then wraps the compiled
    forward); hooks (LoRA, in-place guard, placement) may be attached before or after.
    dynamic: torch.compile's `dynamic` (None: automatic dynamic, see the module docstring).
    mode: torch.compile's mode (None = default; 'max-autotune-no-cudagraphs' tries harder).
    """
    if setting not in SETTINGS:
        raise ValueError(f"compile setting {setting!r}: use one of {', '.join(SETTINGS)}")
    if setting == "off" or not block_paths:
        return lambda: None
    devices = _device_types(model, block_paths)
    if setting == "auto" and any(d.type != "cuda" for d in devices):
        where = ", ".join(sorted({d.type for d in devices if d.type != "cuda"})) or "no device"
        log(f"compile=auto: blocks on {where} run eagerly (auto compiles CUDA blocks only; compile=on forces it)")
        return lambda: None
    reason = compile_support(devices)
    if reason:
        if setting == "on":
            raise RuntimeError(f"compile=on: {reason}")
        log(f"compile=auto: {reason}")
        return lambda: None

    _set_recompile_limit(recompile_limit)
    blocks = [model.get_submodule(p) for p in block_paths]
    for path, block in zip(block_paths, blocks):
        f = block.__dict__.get("forward")           # an undone wrapper may leave the plain bound method
        if f is not None and not (getattr(f, "__func__", None) is type(block).forward
                                  and getattr(f, "__self__", None) is block):
            raise ValueError(f"block {path} already has a wrapped forward (recomputed?): call compile_blocks "
                             "before recompute_blocks")
    forwards = {cls: _ClassForward(cls, *_compiled_forward(cls, dynamic, mode), log, (dynamic, mode))  # per call
                for cls in {type(b) for b in blocks}}
    for block in blocks:
        cls = type(block)
        block.forward = functools.wraps(cls.forward)(functools.partial(forwards[cls], block))
        block.forward._ugpum_compiled = True
        block.forward.recomputed = functools.partial(forwards[cls].recomputed, block)
    classes = sorted({type(b).__name__ for b in blocks})
    log(f"compile={setting}: {len(blocks)} blocks compiled as {len(classes)} shared graph(s) "
        f"({', '.join(classes)}) on {', '.join(sorted(str(d) for d in devices))}; "
        f"recompiles bounded at {recompile_limit} per class")

    def undo():
        for block in blocks:
            if getattr(block.__dict__.get("forward"), "_ugpum_compiled", False):
                del block.forward
    return undo


def _not_one_graph() -> tuple[type, ...]:
    """What Dynamo raises, while tracing or before it starts, for a forward that cannot be one graph. Read
    when an error is caught, not at import: importing Dynamo costs every CLI start seconds."""
    return tuple(getattr(torch._dynamo.exc, name) for name in ("Unsupported", "FailOnRecompileLimitHit")
                 if hasattr(torch._dynamo.exc, name))


def _compiled_forward(cls: type, dynamic, mode, context_fn=None) -> tuple:
    """(forward on copies, its compiled function) of a block class, made once per process and options, so that
    every `compile_blocks` call reuses what Dynamo compiled before. With `context_fn`, the function is the
    forward recomputed in backward under that selective checkpoint (`_recomputed_on_copies`)."""
    with _lock:
        pair = _compiled_forwards.get((cls, (dynamic, mode, context_fn)))
        if pair is None:
            on_copies = _forward_on_copies(cls) if context_fn is None else _recomputed_on_copies(cls, context_fn)
            compiled = torch.compile(on_copies, backend=_counting_backend(cls.__name__), dynamic=dynamic,
                                     fullgraph=True, **({"mode": mode} if mode else {}))
            pair = _compiled_forwards[(cls, (dynamic, mode, context_fn))] = (on_copies, compiled)
    return pair


def _why(err: BaseException) -> str:
    """Dynamo's own explanation of why a forward is not one graph (a recompile-limit failure carries it in its
    cause), else the error's first line."""
    for e in (err, err.__cause__):
        for line in str(e or "").splitlines():
            if line.strip().startswith("Explanation:"):
                return line.strip()[len("Explanation:"):].strip()
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


class _ClassForward:
    """One block class's compiled forward in one `compile_blocks` call; from the first call that cannot be one
    graph, the same forward on copies run eagerly (the copies keep it safe inside `recompute_blocks`, which
    copies nothing for a compiled forward)."""

    def __init__(self, cls: type, on_copies, compiled, log, options=(None, None)):
        self.cls, self.on_copies, self.compiled, self.log = cls, on_copies, compiled, log
        self.options = options                      # (dynamic, mode), for the recomputed function
        self.eager_reason = None

    def __call__(self, block, *args, **kwargs):
        return self._run(self.compiled, self.on_copies, block, args, kwargs)

    def recomputed(self, block, context_fn, *args, **kwargs):
        """The forward recomputed in backward, keeping what `context_fn` (torch's selective checkpoint contexts)
        saves, with the checkpoint inside the compiled graph; eagerly where the class does not compile."""
        if not torch.is_grad_enabled():             # (without gradients nothing is saved: the plain forward serves)
            return self(block, *args, **kwargs)
        eager, compiled = _compiled_forward(self.cls, *self.options, context_fn)     # (the first: uncompiled)
        return self._run(compiled, eager, block, args, kwargs)

    def _run(self, compiled, eager, block, args, kwargs):
        if self.eager_reason is None:
            try:
                return compiled(block, *args, **kwargs)
            except _not_one_graph() as err:         # raised before any kernel ran: running eagerly redoes nothing
                self.eager_reason = _why(err)
                self.log(f"compile: {self.cls.__name__} does not compile as one graph ({self.eager_reason}), so "
                         "its blocks run eagerly")
        return eager(block, *args, **kwargs)


def _own_copy(value):
    return value.clone() if torch.is_tensor(value) and value.is_floating_point() else value


def _forward_on_copies(cls: type):
    """`cls.forward` run on copies of its tensor arguments, copied inside the compiled graph, so that the graph
    mutates none of its inputs (see the module docstring). One code object per class: Dynamo keys its cache
    and its recompile limit on the code object, so classes must not share one."""
    forward = cls.forward

    def forward_on_copies(self, *args, **kwargs):
        return forward(self, *[_own_copy(a) for a in args], **{k: _own_copy(v) for k, v in kwargs.items()})

    return _named(forward_on_copies, f"{cls.__name__}_forward_on_copies")


class _KeptOutputsAreNeverWritten(logging.Filter):
    """Drops torch's warning, at each compile of a selective checkpoint, that the region must not contain in-place
    ops. FLUX.2's blocks add in place, but into their private copies (`_forward_on_copies`), inside a graph that
    AOT autograd makes functional; what the policy keeps (attention's outputs) nothing writes. The LoRA gradients
    equal eager's (tests/integration/test_compile.py)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()


def _recomputed_on_copies(cls: type, context_fn):
    """`_forward_on_copies(cls)` under torch's non-reentrant checkpoint with `context_fn`: compiled as one graph,
    its backward recomputes the forward but for what `context_fn` keeps. A code object of its own (as above)."""
    on_copies = _forward_on_copies(cls)
    warns = logging.getLogger("torch._higher_order_ops.wrap")
    if not any(isinstance(f, _KeptOutputsAreNeverWritten) for f in warns.filters):
        warns.addFilter(_KeptOutputsAreNeverWritten())

    def recomputed_on_copies(self, *args, **kwargs):
        # the keywords stay in the closure: a block keyword can never collide with checkpoint()'s own
        return torch.utils.checkpoint.checkpoint(lambda *a: on_copies(self, *a, **kwargs), *args,
                                                 use_reentrant=False, context_fn=context_fn)
    return _named(recomputed_on_copies, f"{cls.__name__}_recomputed_on_copies")


def _named(function, name: str):
    """`function` with a code object of its own, named `name` (Dynamo's cache and recompile limit key on it)."""
    code = function.__code__.replace(co_name=name)
    return types.FunctionType(code, function.__globals__, code.co_name, None, function.__closure__)
