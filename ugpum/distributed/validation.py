"""The validation loss of a pipeline: forward only, one input at a time through replica 0's stages,
the hidden state sent rank to rank."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..diffusion.flow import flow_loss
from ..train.objective import model_inputs, validation_inputs
from .topology import Topology

_WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_MAX_TENSORS, _SLOT = 4, 8                        # a header slot: dtype, ndim, up to 6 sizes


def _send_hidden(tensors: tuple[torch.Tensor, ...], dst: int, device: torch.device) -> None:
    """A stage's output to rank `dst`: a header (count, dtypes, shapes), then each tensor."""
    header = torch.zeros(1 + _MAX_TENSORS * _SLOT, dtype=torch.int64)
    header[0] = len(tensors)
    for j, t in enumerate(tensors):
        at = 1 + j * _SLOT
        header[at], header[at + 1] = _WIRE_DTYPES.index(t.dtype), t.dim()
        header[at + 2:at + 2 + t.dim()] = torch.tensor(t.shape)
    dist.send(header.to(device), dst)
    for t in tensors:
        dist.send(t.contiguous(), dst)


def _recv_hidden(src: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    header = torch.empty(1 + _MAX_TENSORS * _SLOT, dtype=torch.int64, device=device)
    dist.recv(header, src)
    header = header.cpu().tolist()
    out = []
    for j in range(header[0]):
        at = 1 + j * _SLOT
        t = torch.empty(header[at + 2:at + 2 + header[at + 1]], dtype=_WIRE_DTYPES[header[at]], device=device)
        dist.recv(t, src)
        out.append(t)
    return tuple(out)


@torch.no_grad()
def validation_loss(cfg, spec, stages: list[nn.Module], top: Topology, latents, contexts,
                    picks: list[int]) -> float:
    """`ugpum.train.objective.validation_loss` of the pipeline: the same inputs (`validation_inputs`), one at
    a time through replica 0's stages, the loss on the rank of the last stage, summed in the same
    order; every rank returns it."""
    total = torch.zeros(2, dtype=torch.float64, device=top.device)
    if top.replica == 0:
        last, device, summed, n = top.n_stages - 1, top.device, 0.0, 0
        for x0, noise, t, context in validation_inputs(spec, latents, contexts, picks):
            kw = model_inputs(cfg, spec, x0, noise, t, context, device)
            hidden: tuple = ()
            for s, module in zip(top.stage_ids, stages):
                if s > 0 and top.owner(s - 1) != top.rank:
                    hidden = _recv_hidden(top.owner(s - 1), device)
                out = module(*hidden, **kw)
                hidden = out if isinstance(out, tuple) else (out,)
                if s == last:
                    pred = hidden[0].float()
                    summed += flow_loss(pred, x0.to(pred.device), noise.to(pred.device), t.to(pred.device),
                                        "none").item()
                    n += 1
                elif top.owner(s + 1) != top.rank:
                    _send_hidden(hidden, top.owner(s + 1), device)
        total[0], total[1] = summed, n
    dist.all_reduce(total)                         # from the last stage's rank to every rank
    return float(total[0]) / float(total[1])
