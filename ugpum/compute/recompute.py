"""Per-block recompute: keep only each block's input, and run the block's forward again in backward
(torch's activation checkpointing, `torch.utils.checkpoint`, one block at a time); where the plan says so
(`Workload.attention_kept`), also each block's self-attention output, so that its recompute skips the attention
(torch's selective checkpointing); where the plan says so (`Workload.inputs_on_host`), the kept inputs wait for
their backward in pinned host memory."""
from __future__ import annotations

import contextlib
import functools

import torch.utils.checkpoint
from torch import nn

from .inplace_guard import recompute_block

try:                 # torch's selective checkpointing (2.4 and later): what `keep_attention` needs
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
except ImportError:  # pragma: no cover - an older torch recomputes all of each block (plans never ask for more)
    CheckpointPolicy = create_selective_checkpoint_contexts = None
SELECTIVE_CHECKPOINTING = create_selective_checkpoint_contexts is not None

# A saved tensor goes to host memory under `inputs_on_host` when it carries a gradient and is this large: the
# hidden states between blocks (tens to hundreds of MiB); what every block shares (modulation, text, RoPE
# tables: no gradient) stays where it is.
HOST_MIN_BYTES = 4 * 1024 ** 2

# PyTorch's fused attention forwards (F.scaled_dot_product_attention dispatches to one of them): their outputs
# (the attention output and its softmax statistics, which their backward reads) are what `attention_kept` keeps.
ATTENTION_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu")


@functools.cache
def _attention_ops() -> frozenset:
    """ATTENTION_OPS as this torch has them (once: the policy asks at every op of a recomputed block)."""
    return frozenset(getattr(torch.ops.aten, name).default for name in ATTENTION_OPS if hasattr(torch.ops.aten, name))


def keep_self_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """The selective-checkpoint policy of `attention_kept`: a self-attention's outputs (queries and keys of one
    length) are saved in forward; everything else is recomputed. A block's attention is a fifth of its forward at
    1024² and grows with tokens²; its output is one hidden state's bytes (cross-attention on the text is cheap to
    recompute, and is)."""
    if op in _attention_ops() and args[0].shape[-2] == args[1].shape[-2]:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def attention_kept_contexts():
    """torch.utils.checkpoint's `context_fn` for `keep_self_attention` (one function: compiled graphs key on it)."""
    return create_selective_checkpoint_contexts(keep_self_attention)


def recompute_blocks(model: nn.Module, block_paths: list[str], inputs_on_host: bool = False,
                     device_types: tuple[str, ...] = ("cuda",), keep_attention: bool = False) -> callable:
    """Wrap each block's forward in `recompute_block`; returns a function that undoes it.

    Placement hooks run in `Module.__call__`, outside the wrapped forward, so routing happens once
    and is not repeated during recomputation. FLUX.2 blocks also need `guard_inplace_residuals`.
    A forward compiled by `ugpum.compute.compile` copies its inputs inside its graph and so never writes into
    them: it is recomputed as it is, without `recompute_block`'s eager copies (two per tensor
    argument and block, forward and recomputation).
    `inputs_on_host`: each block's inputs that carry a gradient (`HOST_MIN_BYTES` or more) are saved to pinned
    host memory when the block runs forward and come back to their device for its backward (`inputs_to_host`;
    only from devices of `device_types`).
    `keep_attention`: each block keeps its self-attention output (`keep_self_attention`); a compiled block then
    runs its recompute inside its compiled graph (`ugpum.compute.compile`: torch compiles selective checkpointing
    only from inside), where inductor also fuses the recomputed forward into the backward.
    """
    if keep_attention and inputs_on_host:
        raise ValueError("keep_attention and inputs_on_host: the plan takes one or the other (both hold memory "
                         "for a recomputed block, in opposite directions)")
    originals = {}
    for path in block_paths:
        block = model.get_submodule(path)
        originals[path] = inner = block.forward
        run = _runner(getattr(inner, "_ugpum_compiled", False), keep_attention)
        if inputs_on_host:
            run = functools.partial(_on_host, run, device_types)

        @functools.wraps(inner)
        def wrapped(*args, _inner=inner, _run=run, **kwargs):
            return _run(_inner, *args, **kwargs)

        block.forward = wrapped

    def undo():
        for path, fwd in originals.items():
            model.get_submodule(path).forward = fwd
    return undo


def _runner(compiled: bool, keep_attention: bool):
    """How a block's forward is recomputed: `run(forward, *args, **kwargs)`."""
    if not keep_attention:
        return _recompute_as_is if compiled else recompute_block
    if compiled:
        return lambda forward, *a, **k: forward.recomputed(attention_kept_contexts, *a, **k)
    return functools.partial(recompute_block, context_fn=attention_kept_contexts)


def _recompute_as_is(forward, *args, **kwargs):
    # kwargs stay in the closure so that block keywords never collide with checkpoint()'s own
    return torch.utils.checkpoint.checkpoint(lambda *a: forward(*a, **kwargs), *args, use_reentrant=False)


def _on_host(run, device_types, forward, *args, **kwargs):
    """`run(forward, ...)` with its tensor keywords passed by position (checkpoint saves its positional
    inputs, which `inputs_to_host` then moves; keywords would stay in its closure on the GPU)."""
    names = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    rest = {k: v for k, v in kwargs.items() if k not in names}

    def positional(*a):
        n = len(a) - len(names)
        return forward(*a[:n], **rest, **dict(zip(names, a[n:])))
    with inputs_to_host(device_types):
        return run(positional, *args, *(kwargs[k] for k in names))


@contextlib.contextmanager
def inputs_to_host(device_types: tuple[str, ...] = ("cuda",)):
    """Tensors with a gradient that autograd saves inside this context (a checkpointed block's hidden states)
    wait in pinned host memory, copied out without waiting and back on the same stream when backward unpacks
    them, so each copy is ordered after what wrote the tensor and before what reads it again."""
    def pack(t: torch.Tensor):
        small = t.numel() * t.element_size() < HOST_MIN_BYTES
        if small or not t.requires_grad or t.device.type not in device_types:
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
        host.copy_(t, non_blocking=True)
        return t.device, host

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
