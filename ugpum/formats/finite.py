"""Whether tensors hold only finite numbers: a NaN or an infinity in a model file, a loss, a gradient or a
LoRA about to be saved is found and named, never trained on or written."""
from __future__ import annotations

from collections.abc import Iterable

import torch

from ..wording import EngineError

# fp8 formats have no isfinite kernel everywhere: read their bit patterns instead.
# e4m3fn: NaN is S.1111.111 (no infinities); e5m2: exponent 11111 is an infinity or a NaN.
_FP8_NON_FINITE = {torch.float8_e4m3fn: (0x7F, 0x7F), torch.float8_e5m2: (0x7C, 0x7C)}


class NonFinite(ValueError, EngineError):
    """A tensor holds NaN or infinity; the message names it and says what to do."""


def _finite_flag(t: torch.Tensor) -> torch.Tensor | None:
    """Whether every value of `t` is finite, as a one-value bool tensor on t's device not read yet (None: its
    dtype is finite by kind, integers and empty tensors)."""
    if t.dtype in _FP8_NON_FINITE:
        mask, bad = _FP8_NON_FINITE[t.dtype]
        return ~((t.view(torch.uint8) & mask) == bad).any()
    if not t.is_floating_point() or t.numel() == 0:
        return None
    return torch.isfinite(t).all()


def is_finite(t: torch.Tensor) -> bool:
    """True when every value of `t` is a finite number (integer tensors always are)."""
    flag = _finite_flag(t)
    return flag is None or bool(flag)


def non_finite(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the tensors holding a NaN or an infinity, in order: each device's flags read together, one
    host sync a device instead of one a tensor (a checkpoint holds ~1800 tensors of klein 9B's LoRA and AdamW)."""
    names, flags = [], {}
    for name, t in named:
        flag = _finite_flag(t)
        if flag is not None:
            names.append(name)
            flags.setdefault(flag.device, []).append((len(names) - 1, flag))
    finite = [True] * len(names)
    for per_device in flags.values():
        read = torch.stack([flag for _, flag in per_device]).tolist()
        for (i, _), ok in zip(per_device, read):
            finite[i] = ok
    return [name for name, ok in zip(names, finite) if not ok]


def shown(names: list[str], limit: int = 3) -> str:
    """'a, b, c and 4 more'."""
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
