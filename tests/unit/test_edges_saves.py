"""Issue 26, the saves: a full disk (a real small tmpfs), damaged checkpoints, non-finite tensors, the
run-folder lock, leftovers of killed writers, the base-weights fingerprint. Issue 32: leftovers of writers
killed but not yet reaped (or whose number is reused), names of 255 bytes, an optimizer state of another
rank, checkpoints holding NaN. Real files and processes throughout."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from ugpum.formats.atomic import atomic_path, remove_abandoned
from ugpum.formats.disk_space import DiskFull, size_text
from ugpum.formats.fingerprint import weights_fingerprint
from ugpum.formats.finite import NonFinite, is_finite, non_finite
from ugpum.formats.lora_file import save_lora
from ugpum.compute.lora import attach_lora
from ugpum.train.run.checkpoint import (CheckpointError, check_same_run, latest_checkpoint, load_checkpoint,
                                    remove_leftovers, save_checkpoint)
from ugpum.train.run.lock import LOCK_NAME, RunLock, RunLocked, hold_run_folder
from ugpum.train.stopping import Stopped, stop_on_sigterm, uninterrupted


@pytest.fixture
def small_disk(tmpfs):
    """A real filesystem of 1 MiB (tests/conftest.py: tmpfs)."""
    return tmpfs("1m")


def a_lora(rank: int = 4, width: int = 64):
    model = nn.Sequential(nn.Linear(width, width), nn.Linear(width, width))
    lora = attach_lora(model, ["0", "1"], rank, float(rank), seed=1)
    optimizer = torch.optim.AdamW([p for _, a in lora.items() for p in (a.A, a.B)], lr=1e-3)
    return model, lora, optimizer


def one_step(model, optimizer):
    model(torch.randn(2, model[0].in_features)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_sizes_are_never_rounded_to_nothing():
    assert size_text(812) == "812 bytes"
    assert size_text(3 * 2**20 + 2**19) == "3.5 MiB"


def test_a_write_that_cannot_fit_is_refused_before_it_starts(small_disk):
    final = small_disk / "big.bin"
    with pytest.raises(DiskFull) as caught:
        with atomic_path(final, needed=4 * 2**20, kept="the earlier file is kept") as tmp:
            tmp.write_bytes(b"x")
    text = str(caught.value)
    assert f"no space left on the disk holding {small_disk} for big.bin: it needs about 4.1 MiB and" in text
    assert "MiB are free" in text and text.endswith("the earlier file is kept") and "Errno" not in text
    assert list(small_disk.iterdir()) == []                       # nothing started, nothing left


def test_a_write_that_fills_the_disk_becomes_a_sentence_and_leaves_nothing(small_disk):
    final = small_disk / "grown.bin"
    with pytest.raises(DiskFull) as caught:
        with atomic_path(final) as tmp:                          # size unknown beforehand
            tmp.write_bytes(b"\0" * 2 * 2**20)
    assert "no space left on the disk holding" in str(caught.value) and "are free" in str(caught.value)
    assert list(small_disk.iterdir()) == []


def test_a_checkpoint_that_does_not_fit_is_refused_and_the_earlier_one_stays(small_disk):
    model, lora, optimizer = a_lora(rank=64, width=512)          # 256 KiB of LoRA, 768 KiB of checkpoint
    one_step(model, optimizer)
    with pytest.raises(DiskFull) as caught:
        save_checkpoint(small_disk, 1, lora, optimizer, {})
    assert "for the checkpoint at step 1: it needs about" in str(caught.value)
    assert not [p for p in (small_disk / "checkpoints").iterdir()]          # no half-written folder
    lora_path = save_lora(small_disk / "l.safetensors", {p: (a.A, a.B) for p, a in lora.items()}, 64, 64.0)
    assert lora_path.is_file()                                   # the smaller LoRA still fits


def test_nothing_non_finite_is_ever_saved(tmp_path):
    model, lora, optimizer = a_lora()
    one_step(model, optimizer)
    save_checkpoint(tmp_path, 1, lora, optimizer, {})
    with torch.no_grad():
        next(iter(lora.items()))[1].B[0, 0] = float("nan")
    with pytest.raises(NonFinite, match="not saved, the LoRA holds NaN or infinite values"):
        save_checkpoint(tmp_path, 2, lora, optimizer, {})
    with pytest.raises(NonFinite, match="not saved"):
        save_lora(tmp_path / "x.safetensors", {p: (a.A, a.B) for p, a in lora.items()}, 4, 4.0)
    assert latest_checkpoint(tmp_path).name == "step_000001" and not (tmp_path / "x.safetensors").exists()


def test_non_finite_names_each_bad_tensor_in_order_from_one_read_of_a_device(monkeypatch):
    fp8 = torch.tensor([1.0, 2.0]).to(torch.float8_e4m3fn)
    named = [("good", torch.ones(3)), ("nan", torch.tensor([0.0, float("nan")])), ("int", torch.tensor([1, 2])),
             ("empty", torch.empty(0)), ("fp8", fp8), ("bad fp8", torch.tensor([0x7F], dtype=torch.uint8).view(
                 torch.float8_e4m3fn)), ("inf", torch.tensor([float("-inf")], dtype=torch.bfloat16))]
    reads, tolist = [], torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.numel()) or tolist(t))
    assert non_finite(named) == ["nan", "bad fp8", "inf"]
    assert reads == [5]                             # the five float tensors' flags, read at once (one device)
    assert non_finite(named[:1]) == [] and non_finite([]) == []


def test_fp8_non_finite_values_are_found():
    t = torch.zeros(4, dtype=torch.float32).to(torch.float8_e4m3fn)
    assert is_finite(t)
    t.view(torch.uint8)[2] = 0x7F                                # e4m3fn's NaN
    assert not is_finite(t)
    assert not is_finite(torch.tensor([1.0, float("inf")], dtype=torch.bfloat16))


@pytest.mark.parametrize("damage", ["cut", "empty"])
@pytest.mark.parametrize("victim", ["lora.safetensors", "optimizer.safetensors"])
def test_a_damaged_checkpoint_is_skipped_for_the_one_before_saying_so(tmp_path, damage, victim):
    model, lora, optimizer = a_lora()
    for step in (1, 2, 3):
        one_step(model, optimizer)
        save_checkpoint(tmp_path, step, lora, optimizer, {})
    hit = tmp_path / "checkpoints" / "step_000003" / victim
    hit.write_bytes(hit.read_bytes()[: hit.stat().st_size // 2] if damage == "cut" else b"")
    said = []
    assert latest_checkpoint(tmp_path, said.append).name == "step_000002"
    state = "cut short or damaged" if damage == "cut" else "empty"
    assert said == [f"checkpoint step_000003 cannot be used ({victim} is {state}): continuing from the newest "
                    "intact one, step_000002, instead"]
    with pytest.raises(CheckpointError, match=f"cannot resume from it: {victim} is {state}"):
        load_checkpoint(hit.parent, lora, optimizer)
    load_checkpoint(tmp_path / "checkpoints" / "step_000002", lora, optimizer)     # the fallback loads


def test_leftovers_of_killed_writers_go_and_writes_under_way_stay(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    latents = tmp_path / "cache" / "latents"
    latents.mkdir(parents=True)
    killed = latents / f".abc.safetensors.{dead.pid}-0123456789ab.tmp"
    older = tmp_path / ".ugpum_lora.safetensors.0123456789ab.tmp"             # an older version's name
    under_way = latents / f".def.safetensors.{os.getppid()}-0123456789ab.tmp"   # a live process writes it
    for p in (killed, older, under_way):
        p.write_bytes(b"half")
    removed = remove_leftovers(tmp_path)
    assert sorted(removed) == sorted([killed, older]) and under_way.exists()


def test_one_run_at_a_time_and_a_killed_runs_lock_is_taken_over(tmp_path):
    out = tmp_path / "run"
    with hold_run_folder(out) as lock:
        assert (out / LOCK_NAME).is_file()
        with pytest.raises(RunLocked, match=rf"{out} is in use by another run \(process {os.getpid()} on "):
            RunLock(out).acquire()
    assert not (out / LOCK_NAME).exists()                       # released and gone
    # what a killed run leaves: the file naming it, but no lock (the system released it with the process)
    (out / LOCK_NAME).write_text('{"pid": 999999999, "host": "h", "started": 0}')
    said = []
    with hold_run_folder(out, said.append) as lock:
        assert lock.taken_over["pid"] == 999999999
    assert said and "took over the lock a run that ended without releasing it left" in said[0]


def test_a_sigterm_while_the_lock_is_taken_stops_the_run_once_it_is_held_and_leaves_no_lock(tmp_path):
    # (the run's own order, ugpum/train/loop.py: a stop that came mid-acquire left the lock file and said nothing)
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers exist only in the main thread")
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_NAME).write_text('{"pid": 999999999, "host": "h", "started": 0}')   # so taking it logs a line
    held_when_stopped = []
    with pytest.raises(Stopped), contextlib.ExitStack() as held:
        held.enter_context(stop_on_sigterm())
        with uninterrupted():
            lock = held.enter_context(hold_run_folder(out, lambda _line: os.kill(os.getpid(), signal.SIGTERM)))
            held_when_stopped.append((out / LOCK_NAME).is_file() and lock.taken_over is not None)
    assert held_when_stopped == [True]          # the block went on to hold the lock; the stop came after it
    assert not (out / LOCK_NAME).exists()       # and the stack that held it let it go


def model_file(path: Path, value: float) -> Path:
    save_file({"a.weight": torch.full((64, 64), value), "b.weight": torch.full((8,), 1.0)}, str(path))
    return path


def test_the_fingerprint_tells_other_weights_under_the_same_header(tmp_path):
    one, same, other = (model_file(tmp_path / f"{n}.safetensors", v) for n, v in (("1", 0.5), ("2", 0.5), ("3", 0.25)))
    assert weights_fingerprint(one) == weights_fingerprint(same) != weights_fingerprint(other)
    ident = lambda f: {"config": {}, "dataset_hash": "d", "lora_shapes": {},               # noqa: E731
                       "model": {"id": "m", "header_digest": "h", "weights_fingerprint": weights_fingerprint(f)}}
    check_same_run(ident(one), ident(same), tmp_path / "c" / "step_000001")
    with pytest.raises(ValueError, match="base weights"):
        check_same_run(ident(one), ident(other), tmp_path / "c" / "step_000001")


# ---------------------------------------------------------------- issue 32

def test_a_killed_writers_temporary_goes_even_before_its_process_is_reaped_or_when_its_number_is_reused(tmp_path):
    zombie = subprocess.Popen(["sleep", "60"])
    zombie.kill()                                   # killed, not waited for: a zombie that os.kill(pid, 0) still finds
    reused = subprocess.Popen(["sleep", "60"])      # a live process whose number a file written earlier names
    try:
        time.sleep(0.2)
        killed = tmp_path / f".ugpum_lora.safetensors.{zombie.pid}-0123456789ab.tmp"
        older = tmp_path / f".ugpum_lora_step2.safetensors.{reused.pid}-0123456789ab.tmp"
        under_way = tmp_path / f".ugpum_lora_step3.safetensors.{reused.pid}-0123456789ac.tmp"
        for p in (killed, older, under_way):
            p.write_bytes(b"half")
        an_hour_ago = time.time() - 3600
        os.utime(older, (an_hour_ago, an_hour_ago))     # written before that process started: not its write
        assert sorted(remove_abandoned(tmp_path)) == sorted([killed, older]) and under_way.exists()
    finally:
        reused.kill()
        reused.wait()
        zombie.wait()


def test_a_name_that_takes_all_255_bytes_still_writes_through_its_temporary(tmp_path):
    final = tmp_path / ("x" * 243 + ".safetensors")              # 255 bytes: the longest name a file may have
    with atomic_path(final) as tmp:
        assert len(tmp.name.encode()) <= 255 and tmp.name.endswith(".tmp")
        tmp.write_bytes(b"lora")
    assert final.read_bytes() == b"lora" and [p.name for p in tmp_path.iterdir()] == [final.name]


def saved_steps(tmp_path, rank: int = 4, steps=(1, 2)):
    model, lora, optimizer = a_lora(rank=rank)
    for step in steps:
        one_step(model, optimizer)
        save_checkpoint(tmp_path, step, lora, optimizer, {})
    return lora, optimizer


def test_an_optimizer_state_of_another_rank_is_found_and_the_checkpoint_before_it_used(tmp_path):
    lora, optimizer = saved_steps(tmp_path / "run", rank=4)
    saved_steps(tmp_path / "other", rank=8)
    victim = tmp_path / "run" / "checkpoints" / "step_000002" / "optimizer.safetensors"
    shutil.copy(tmp_path / "other" / "checkpoints" / "step_000002" / "optimizer.safetensors", victim)
    said = []
    assert latest_checkpoint(tmp_path / "run", said.append).name == "step_000001"
    assert said == ["checkpoint step_000002 cannot be used (optimizer.safetensors does not fit the LoRA (exp_avg of "
                    "0.A is [8, 64], the LoRA's [4, 64]: it is the state of a run of another rank or other targets)): "
                    "continuing from the newest intact one, step_000001, instead"]
    with pytest.raises(CheckpointError, match=r"cannot resume from it: optimizer\.safetensors does not fit the LoRA"):
        load_checkpoint(victim.parent, lora, optimizer)


@pytest.mark.parametrize("victim", ["lora.safetensors", "optimizer.safetensors"])
def test_a_checkpoint_holding_nan_is_not_resumed_from(tmp_path, victim):
    from safetensors.torch import load_file
    saved_steps(tmp_path)
    path = tmp_path / "checkpoints" / "step_000002" / victim
    tensors = load_file(str(path))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone().fill_(float("nan"))
    save_file(tensors, str(path))                                 # a whole, well-formed file: only its numbers are bad
    assert latest_checkpoint(tmp_path).name == "step_000002"      # (headers alone cannot tell)
    said = []
    assert latest_checkpoint(tmp_path, said.append, deep=True).name == "step_000001"
    assert said == [f"checkpoint step_000002 cannot be used ({victim} holds NaN or infinite values ({name})): "
                    "continuing from the newest intact one, step_000001, instead"]


def test_an_optimizer_state_holding_nan_is_never_saved(tmp_path):
    model, lora, optimizer = a_lora()
    one_step(model, optimizer)
    next(iter(optimizer.state.values()))["exp_avg_sq"][0, 0] = float("inf")
    with pytest.raises(NonFinite, match="not saved, the optimizer's state holds NaN or infinite values"):
        save_checkpoint(tmp_path, 1, lora, optimizer, {})
    assert latest_checkpoint(tmp_path) is None


@pytest.mark.parametrize("fused_before, fused_after", [(False, True), (True, False)])
def test_a_checkpoint_resumes_with_the_other_adamw_kernel_on_the_same_path(tmp_path, fused_before, fused_after):
    """The fused AdamW (what training takes since 2026-12-07) and the unfused one (checkpoints before it) read
    each other's checkpoints: each keeps its own kernel, its step counts where it keeps them, and two more
    steps give the LoRA of the run that never stopped."""
    def run(fused):
        model, lora, _ = a_lora()
        optimizer = torch.optim.AdamW([p for _, a in lora.items() for p in (a.A, a.B)], lr=1e-3, fused=fused)
        return model, lora, optimizer
    torch.manual_seed(0)
    model, lora, optimizer = run(fused_before)
    for _ in range(3):
        one_step(model, optimizer)
    folder = save_checkpoint(tmp_path, 3, lora, optimizer, {})
    rng = torch.get_rng_state()
    for _ in range(2):
        one_step(model, optimizer)
    model2, lora2, resumed = run(fused_after)
    model2.load_state_dict(model.state_dict())                  # the same frozen base
    load_checkpoint(folder, lora2, resumed)
    torch.set_rng_state(rng)                                    # the same two batches
    assert resumed.param_groups[0]["fused"] is fused_after
    assert all(isinstance(s["step"], torch.Tensor) and float(s["step"]) == 3 for s in resumed.state.values())
    for _ in range(2):
        one_step(model2, resumed)
    for (_, a), (_, b) in zip(lora.items(), lora2.items()):
        torch.testing.assert_close(b.B, a.B, rtol=1e-6, atol=1e-8)
