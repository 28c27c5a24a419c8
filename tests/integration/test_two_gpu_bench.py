"""GPU-to-GPU copies staged through host memory (`ugpum.placement.copy.staged_copies`, issue 7), which must
give exactly what direct copies give; and the two-GPU benchmark (replicas against the split, issue 40) on CPU.

On CPU a "staged" copy between CPU tensors runs the same two copies through a host buffer without
streams; the CUDA tests (skipped here) check the stream ordering on one GPU and, with two GPUs, that a
split model trains the same with either path.
"""
from __future__ import annotations

import json

import pytest
import torch

from support.bench_run import run_bench
from support.toy_dit import ToyDiT
from ugpum.placement.copy import STAGED_ENV, direct_gpu_copy, gpu_copy, staged_copy, staged_copies, staged_copies_enabled
from ugpum.placement.pipeline import accumulate
from ugpum.placement.place import Layout, place

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


# ------------------------------------------------------------------------------------------
# the switch
# ------------------------------------------------------------------------------------------

def test_staged_switch_follows_the_environment_and_the_context(monkeypatch):
    monkeypatch.delenv(STAGED_ENV, raising=False)
    assert staged_copies_enabled() is False
    for value, expected in (("1", True), ("on", True), ("0", False), ("off", False), ("", False)):
        monkeypatch.setenv(STAGED_ENV, value)
        assert staged_copies_enabled() is expected, value
    monkeypatch.setenv(STAGED_ENV, "1")
    with staged_copies(False):
        assert staged_copies_enabled() is False             # the context wins over the environment
        with staged_copies():
            assert staged_copies_enabled() is True
        assert staged_copies_enabled() is False
    with pytest.raises(RuntimeError, match="boom"):
        with staged_copies(False):
            raise RuntimeError("boom")
    assert staged_copies_enabled() is True                  # restored after an error too
    monkeypatch.setenv(STAGED_ENV, "maybe")
    with pytest.raises(ValueError, match=f"{STAGED_ENV}='maybe'"):
        staged_copies_enabled()


# ------------------------------------------------------------------------------------------
# the staging function
# ------------------------------------------------------------------------------------------

def _tensors(device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 10, generator=g)
    return [t.to(device) for t in (
        base,
        base.t(),                                    # not contiguous
        base.to(torch.bfloat16)[:, ::3],             # strided, bf16
        torch.tensor(3.5),                           # 0-d
        torch.empty(0, 4),                           # empty
        torch.arange(12, dtype=torch.int64).reshape(3, 4),
    )]


@pytest.mark.parametrize("i", range(6))
def test_staged_copy_on_cpu_is_an_exact_independent_copy(i):
    x = _tensors("cpu")[i]
    before = x.clone()
    y = staged_copy(x, torch.device("cpu"))
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device and y.is_contiguous()
    assert torch.equal(y, x)
    if x.numel():
        assert y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
        y.add_(1)                                     # the copy owns its memory
        assert torch.equal(x, before)


def _split_toy(devices: tuple[str, str], staged: bool, schedule: str):
    """LoRA-free toy DiT split in two stages over `devices`: loss and every parameter's gradient
    after one pipelined step of 3 micro-batches, with copies direct or staged."""
    torch.manual_seed(0)
    model = ToyDiT().double()
    paths = model.block_paths()
    blocks = {p: devices[0] if k < 3 else devices[1] for k, p in enumerate(paths)}
    layout = Layout(blocks, devices[0], devices[1], ("final_layer",), (tuple(paths[:3]), tuple(paths[3:])))
    placement = place(model, layout)
    g = torch.Generator().manual_seed(1)
    mbs = [(torch.randn(2, 5, 8, generator=g, dtype=torch.float64).to(devices[0]),
            torch.randn(2, 4, generator=g, dtype=torch.float64).to(devices[0])) for _ in range(3)]

    def step(mb):
        return model(*mb).pow(2).mean() / 3

    with staged_copies(staged):
        losses = accumulate(step, mbs, schedule, layout, model)
    grads = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters() if p.grad is not None}
    placement.undo()
    return [float(v) for v in losses], grads


SPLITS = [("cpu", "cpu")] + ([("cuda:0", "cuda:1")] if torch.cuda.device_count() >= 2 else [])


@pytest.mark.parametrize("devices", SPLITS)
@pytest.mark.parametrize("schedule", ["sequential", "1f1b"])
def test_split_trains_the_same_with_staged_copies(devices, schedule):
    """On cpu/cpu no tensor changes device (the test checks the switch leaves the rest alone); on two
    GPUs every boundary copy, forward and backward, goes through host memory."""
    direct_losses, direct = _split_toy(devices, False, schedule)
    staged_losses, staged = _split_toy(devices, True, schedule)
    # the same bytes arrive either way; on GPUs leave room only for cuBLAS choosing other kernels
    tol = {} if devices[0] == "cpu" else {"rtol": 1e-12, "atol": 1e-15}
    assert staged_losses == pytest.approx(direct_losses, rel=tol.get("rtol", 0), abs=tol.get("atol", 0))
    assert direct.keys() == staged.keys() and len(direct) > 10
    for name, g in direct.items():
        torch.testing.assert_close(staged[name], g, rtol=tol.get("rtol", 0), atol=tol.get("atol", 0), msg=name)
    assert any(float(g.abs().max()) > 0 for g in direct.values())


@cuda
@pytest.mark.parametrize("i", range(6))
def test_staged_copy_waits_for_its_producer_on_the_gpu(i):
    """One GPU: both ends on cuda:0, so the two side streams and the event order are real."""
    dev = torch.device("cuda", 0)
    a = torch.randn(1024, 1024, device=dev)
    for _ in range(3):
        h = a
        for _ in range(20):                     # keep the compute stream busy when the copy is issued
            h = torch.tanh(h @ a) * 0.5
        x = _tensors("cuda:0")[i]
        x.add_(h[0, 0].to(x.dtype) * 0)         # written after the busy work (views keep their strides)
        staged = staged_copy(x, dev)
        direct = direct_gpu_copy(x, dev)
        torch.testing.assert_close(staged, direct, rtol=0, atol=0)
        torch.testing.assert_close(staged, x, rtol=0, atol=0)


@cuda
def test_gpu_copy_takes_the_path_the_switch_says():
    dev = torch.device("cuda", 0)
    x = torch.randn(256, device=dev)
    with staged_copies():
        y, stream = gpu_copy(x, dev)
    from ugpum.placement.copy import edge_streams
    out_stream, in_stream = edge_streams(dev, dev)
    assert stream == in_stream and torch.equal(y, x)
    with staged_copies(False):
        y, stream = gpu_copy(x, dev)
    assert stream == out_stream and torch.equal(y, x)


@two_gpus
def test_staged_copy_between_two_gpus_is_exact_both_ways():
    for src, dst in (("cuda:0", "cuda:1"), ("cuda:1", "cuda:0")):
        for x in _tensors(src):
            y = staged_copy(x, torch.device(dst))
            assert y.device == torch.device(dst)
            torch.testing.assert_close(y.cpu(), x.cpu(), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------
# the benchmark on CPU (the tiny model): replicas against the split, through `python -m ugpum train`
# ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_bench_measures_replicas_against_the_split_on_two_cpu_devices(tmp_path):
    rows = tmp_path / "rows.jsonl"
    done = run_bench("two_gpu", ["--profile", "tiny-flux2", "--devices", "cpu,cpu", "--grad-accum", "2", "--steps", "2",
                                 "--warmup", "1", "--rows", str(rows), "--work", str(tmp_path / "work")], threads=1)
    assert done.returncode == 0, done.stderr[-3000:]
    split, replicas, compared = [json.loads(line) for line in rows.read_text().splitlines()]
    assert (split["layout"], split["copies"], split["shares"]) == ("split", 1, [2])
    assert (replicas["layout"], replicas["copies"], replicas["shares"]) == ("replicas", 2, [1, 1])
    for run in (split, replicas):
        assert run["s_per_step"] > 0 and len(run["step_times"]) == 2 and run["forecast_s"] > 0
    assert compared["compare"] == "replicas vs split" and compared["speedup"] > 0
    assert compared["lora_relative_difference"] < 1e-6            # the same LoRA, whichever layout trains it
    assert "grad-accum 2: split" in done.stdout


@pytest.mark.slow
def test_bench_measures_two_workers_against_one_on_one_device_named_twice(tmp_path):
    """What one process loses driving two replicas, through the CLI: one copy on the first device against two
    replicas on the one device named twice, the same micro-batches, the same LoRA."""
    rows = tmp_path / "rows.jsonl"
    done = run_bench("two_gpu", ["--profile", "tiny-flux2", "--devices", "cpu,cpu", "--layouts", "one,replicas",
                                 "--grad-accum", "2", "--steps", "2", "--warmup", "1", "--rows", str(rows), "--work",
                                 str(tmp_path / "work")], threads=1)
    assert done.returncode == 0, done.stderr[-3000:]
    one, replicas, compared = [json.loads(line) for line in rows.read_text().splitlines()]
    assert (one["layout"], one["copies"], one["shares"]) == ("one", 1, [2])
    assert (replicas["layout"], replicas["copies"], replicas["shares"]) == ("replicas", 2, [1, 1])
    assert compared["compare"] == "replicas vs one" and compared["lora_relative_difference"] < 1e-6
    assert "grad-accum 2: one" in done.stdout


@pytest.mark.parametrize("bad, message", [
    (["--layouts", "one,one"], "two of split, one, replicas"),
    (["--devices", "cpu"], "name two devices"),
    (["--grad-accum", "3"], "even numbers of at least 2"),
    (["--steps", "1"], "more than --warmup"),
])
def test_bench_refuses_bad_arguments(tmp_path, bad, message):
    done = run_bench("two_gpu", ["--profile", "tiny-flux2", "--devices", "cpu,cpu", "--rows", str(tmp_path / "r"),
                                 "--work", str(tmp_path / "w"), *bad])
    assert done.returncode != 0 and message in done.stderr
