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


def is_finite(t: torch.Tensor) -> bool:
    """True when every value of `t` is a finite number (integer tensors always are)."""
    if t.dtype in _FP8_NON_FINITE:
        mask, bad = _FP8_NON_FINITE[t.dtype]
        return not bool(((t.view(torch.uint8) & mask) == bad).any())
    if not t.is_floating_point() or t.numel() == 0:
        return True
    return bool(torch.isfinite(t).all())


def non_finite(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the tensors holding a NaN or an infinity, in order."""
    return [name for name, t in named if not is_finite(t)]


def shown(names: list[str], limit: int = 3) -> str:
    """'a, b, c and 4 more'."""
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
