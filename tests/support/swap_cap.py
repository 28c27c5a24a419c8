"""A memory cap under which one CPU "device" must swap some, not all, of tiny-flux2's blocks."""
from ugpum.arch import Workload, get_spec
from ugpum.planning.devices import host_device
from ugpum.planning.plan import HEADROOM, StageCosts

TINY_WORKLOAD = Workload(width=64, height=64, text_tokens=8, checkpointing=True, rank=2)


def swap_forcing_cap_gib(workload: Workload = TINY_WORKLOAD) -> float:
    """Halfway between what the model needs with no block swapped and with every block swapped, for
    `workload` (default: the benchmarks' tiny shapes)."""
    spec = get_spec("tiny-flux2")
    dev = host_device()
    n = len(spec.blocks)
    ev = StageCosts(spec, [dev], workload, 1)
    need = (sum(ev._memory(0, 0, n, ()).values()) + sum(ev._memory(0, 0, n, tuple(range(n))).values())) / 2
    return need / (1 - HEADROOM) / 2 ** 30              # the host's free memory whose budget that is
