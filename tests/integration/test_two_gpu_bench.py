"""Issue 7: the two-GPU benchmark's whole path on CPU with tiny models, and GPU-to-GPU copies staged
through host memory (`ugpum.placement.copy.staged_copies`), which must give exactly what direct copies give.

On CPU a "staged" copy between CPU tensors runs the same two copies through a host buffer without
streams; the CUDA tests (skipped here) check the stream ordering on one GPU and, with two GPUs, that a
split model trains the same with either path.
"""
from __future__ import annotations

import json

import pytest
import torch

from support.bench_run import run_bench
from support.swap_cap import swap_forcing_cap_gib
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
# the benchmark on CPU (tiny models): every case, entries, table, errors
# ------------------------------------------------------------------------------------------

def _args(tmp_path, *more: str) -> list[str]:
    """Tiny shapes, two steps, m = 1 and 2 wherever the GPU session uses more."""
    return ["--devices", "cpu,cpu", "--model", "tiny-flux2", "--resolution", "64", "--text-tokens", "8",
            "--rank", "2", "--steps", "2", "--warmup", "1", "--micro-batches", "1,2", "--wan-micro-batches", "1,2",
            "--mixed-micro-batches", "2", "--copy-micro-batches", "1,2",
            "--out", str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ckpt"), *more]


FIELDS = ("case", "devices", "caps_gib", "micro_batches", "schedule", "s_per_step", "peak_gib", "forecast_gib",
          "stages", "command", "torch", "gpus", "predicted_s", "forecast_error", "error")


def two_gpu(argv: list[str]) -> int:
    """bench/two_gpu.py as a user runs it (one intra-op thread: faster for tiny models)."""
    done = run_bench("two_gpu", argv, threads=1)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.returncode


@pytest.mark.slow
def test_bench_cpu_smoke_every_case(comfy, tmp_path):
    args = _args(tmp_path, "--cap-gib", repr(swap_forcing_cap_gib()))
    assert two_gpu(args) == 0
    assert not (tmp_path / "ckpt" / "tiny-flux2.safetensors").exists()      # written by the run, then deleted
    entries = json.loads((tmp_path / "out" / "two_gpu.json").read_text())
    runs = sorted((e["case"], e["variant"], e["micro_batches"], e["schedule_requested"], e["staged_copies"])
                  for e in entries)
    assert runs == sorted(
        [("wan_split", "split", 1, "auto", False), ("wan_split", "split", 2, "auto", False),
         ("wan_split", "split_1f1b", 2, "1f1b", False), ("wan_split", "swap", 1, "sequential", False)]
        + [("klein_schedules", "one_gpu", m, "sequential", False) for m in (1, 2)]
        + [("klein_schedules", "split", m, s, False) for m in (1, 2) for s in ("sequential", "gpipe", "1f1b")]
        + [("mixed_caps", v, 2, "auto", False) for v in ("planner", "even")]
        + [("staged_copies", "copies", m, "auto", staged) for m in (1, 2) for staged in (False, True)])
    for e in entries:
        assert all(k in e for k in FIELDS), [k for k in FIELDS if k not in e]
        assert e["error"] is None and e["s_per_step"] > 0 and len(e["step_times"]) == 2
        assert e["peak_gib"] is None and e["caps_applied"] is False        # no allocator to cap on CPU
        assert set(e["forecast_gib"]) == {"cpu"}
        assert e["forecast_gib"]["cpu"] == pytest.approx(sum(s["forecast_gib"] for s in e["stages"]), abs=2e-3)
        assert sum(s["blocks"][1] - s["blocks"][0] for s in e["stages"]) == 5
        assert e["schedule"] in ("sequential", "gpipe", "1f1b") and e["final_loss"] > 0
    by = {(e["case"], e["variant"], e["micro_batches"], e["schedule"], e["staged_copies"]): e for e in entries}

    swap = by[("wan_split", "swap", 1, "sequential", False)]
    assert swap["devices"] == ["cpu"] and swap["stages"][0]["offloaded"]
    assert 0 < swap["swap_bytes_per_step"] <= swap["forecast_swap_bytes_per_step"]
    forced = by[("wan_split", "split_1f1b", 2, "1f1b", False)]
    assert forced["grad_rel_diff"] == {"1f1b vs sequential": pytest.approx(0.0, abs=1e-6)}
    assert forced["comparison"]["throughput_ratio"] == pytest.approx(
        (2 / forced["s_per_step"]) / (1 / swap["s_per_step"]), rel=1e-3)

    for m in (1, 2):
        one = by[("klein_schedules", "one_gpu", m, "sequential", False)]
        for s in ("sequential", "gpipe", "1f1b"):
            c = by[("klein_schedules", "split", m, s, False)]["comparison"]
            assert c["bound"] == pytest.approx(2 * m / (m + 1), abs=1e-4)
            assert c["throughput_ratio"] == pytest.approx(
                one["s_per_step"] / by[("klein_schedules", "split", m, s, False)]["s_per_step"], rel=1e-3)
            assert ("overhead" in c) == (m == 1)

    even = next(e for e in entries if e["variant"] == "even")
    assert [s["blocks"] for s in even["stages"]] == [[0, 3], [3, 5]]
    assert next(e for e in entries if e["variant"] == "planner")["comparison"]["against"].startswith("even")

    copies = [e for e in entries if e["case"] == "staged_copies"]
    for e in copies:
        assert e["grad_rel_diff"] == {"run's schedule, direct copies": 0.0, "run's schedule, staged copies": 0.0}
        pairs = e["copy_bandwidth"]["pairs"]
        assert [p["mib"] for p in pairs] == [0.003, 4.0]          # the boundary, and a large copy
        assert all(p["direct_exact"] and p["staged_exact"] and p["direct_gbps"] > 0 and p["staged_gbps"] > 0
                   for p in pairs)
    assert all("extra_s_per_step" in e["comparison"] for e in copies if e["staged_copies"])

    md = (tmp_path / "out" / "two_gpu.md").read_text()
    assert "## Targets" in md and "| wan_split | swap | cpu |" in md and "## Copy bandwidth" in md
    assert "n/a (one device for both)" in md and "two_gpu.py" in md.split("## Commands")[1]

    # measured again: the entry is replaced, not added
    assert two_gpu(_args(tmp_path, "--cases", "mixed_caps", "--only", "mixed_caps/even")) == 0
    again = json.loads((tmp_path / "out" / "two_gpu.json").read_text())
    assert len(again) == len(entries) and sum(e["variant"] == "even" for e in again) == 1
    assert next(e for e in again if e["variant"] == "even")["step_times"] != even["step_times"]


@pytest.mark.slow
def test_bench_run_in_its_own_process_and_a_failing_run(comfy, tmp_path):
    # caps too small for the model even with every block swapped: an entry that says so, exit code 1
    done = run_bench("two_gpu", _args(tmp_path, "--cases", "mixed_caps", "--only", "mixed_caps/even", "--keep-ckpt",
                                      "--mixed-caps-gib", "0.0001,0.0001"), threads=1)
    assert done.returncode == 1
    [failed] = json.loads((tmp_path / "out" / "two_gpu.json").read_text())
    assert failed["s_per_step"] is None and failed["error"].startswith("PlanError: manual split [3, 2]")
    assert "do not fit on cpu capped at 0.0001 GiB" in (tmp_path / "out" / "two_gpu.md").read_text()

    # the run in a child process (as on CUDA), merged into the same results
    assert two_gpu(_args(tmp_path, "--cases", "mixed_caps", "--only", "mixed_caps/planner", "--isolate", "always")) == 0
    entries = json.loads((tmp_path / "out" / "two_gpu.json").read_text())
    assert [e["variant"] for e in entries] == ["even", "planner"]
    assert entries[1]["s_per_step"] > 0 and entries[1]["error"] is None and "comparison" not in entries[1]


@pytest.mark.parametrize("bad, message", [
    (["--devices", "cpu"], "needs two devices"),
    (["--devices", "cpu,cpu", "--model", ""], "only tiny models"),
    (["--cases", "wan_split,nope"], "nope"),
    (["--wan-schedules", "fastest"], "fastest"),
    (["--mixed-caps-gib", "16"], "two positive GiB"),
    (["--steps", "1"], "more than --warmup"),
])
def test_bench_refuses_bad_arguments(tmp_path, bad, message):
    done = run_bench("two_gpu", _args(tmp_path) + bad)
    assert done.returncode != 0 and message in done.stderr


def test_bench_refuses_a_broken_results_file(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "two_gpu.json").write_text("{not json")
    done = run_bench("two_gpu", _args(tmp_path))
    assert done.returncode != 0 and "two_gpu.json is not valid JSON" in done.stderr
    assert not (tmp_path / "ckpt").exists()                 # stopped before writing anything
