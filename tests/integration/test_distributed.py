"""The same plan on torch.distributed.pipelining (README "Past one machine"), on the CPU with gloo.

First the stage modules alone, in one process: a chain of stages of ComfyUI's tiny FLUX.2 and Wan
gives the model's own loss and LoRA gradients. Then real torchrun jobs (`python -m
torch.distributed.run ... -m ugpum train ... --distributed`): the LoRA after a few steps equals the
single-process `python -m ugpum train` run with the same global batch (relative difference < 1e-6,
fp32), and so do the logged losses and validation losses, for 2 ranks (2 stages) and 4 ranks (2
stages x 2 replicas), each schedule, the two-stages-per-rank ones (interleaved 1F1B, zero bubble)
included; a run resumes exactly with another number of replicas (2 -> 1 and, after a SIGTERM to one
rank that ends every rank with one sentence and a checkpoint, 1 -> 2).
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from comfy_bridge import find_comfyui
from support.cli_run import main_here

pytestmark = pytest.mark.skipif(find_comfyui() is None, reason="needs ComfyUI's model classes")
ROOT = Path(__file__).resolve().parents[2]
DATASET = ROOT / "demo_datasets" / "loranne"


# ------------------------------------------------------------------------------------ stages alone

def _chain(stages, kwargs):
    """Forward through the stages with a cut between each (as ranks are cut), then the backward of
    each stage from the next one's input gradients; returns the model output and the loss fn."""
    cuts, hidden = [], ()
    for st in stages:
        leaves = tuple(h.detach().requires_grad_() for h in hidden)
        out = st(*leaves, **kwargs)
        out = out if isinstance(out, tuple) else (out,)
        cuts.append((leaves, out))
        hidden = out
    return hidden[0], cuts


def _backward(loss, cuts):
    grads = None
    for leaves, out in reversed(cuts):
        torch.autograd.backward([loss] if grads is None else list(out), grads)
        grads = [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("profile, latent, splits", [
    ("tiny-flux2", (128, 4, 4), ([(0, 1), (1, 5)], [(0, 2), (2, 3), (3, 5)])),
    ("tiny-wan", (16, 2, 8, 8), ([(0, 1), (1, 2), (2, 3)],)),
])
def test_a_chain_of_stages_is_the_models_own_forward(comfy, profile, latent, splits):
    """Loss and every LoRA gradient of ComfyUI's forward, whatever the cut: inside FLUX.2's double
    blocks, at the double/single boundary and inside the singles; Wan's blocks; 2 and 3 stages."""
    from comfy_bridge import build_random
    from ugpum.arch import get_spec
    from ugpum.compute.recompute import recompute_blocks
    from ugpum.train.objective import micro_batch_inputs
    from ugpum.distributed.stages import stage_module, stage_ranges
    from ugpum.compute.inplace_guard import guard_inplace_residuals
    from ugpum.train.config import load_config
    from ugpum.diffusion.flow import flow_loss, noisy
    from ugpum.compute.lora import attach_lora, lora_targets
    from ugpum.train.objective import micro_loss
    cfg = load_config(profile, overrides=dict(devices=["cpu"]))
    spec = get_spec(cfg.model)
    g = torch.Generator().manual_seed(0)
    latents = [torch.randn(*latent, generator=g) for _ in range(2)]
    contexts = [torch.randn(7, spec.context_dim, generator=g) for _ in range(2)]
    model = build_random(spec, torch.float32, seed=3)
    paths = [b.path for b in spec.blocks]
    guard_inplace_residuals(model, include_rms=False)
    recompute_blocks(model, paths)
    lora = attach_lora(model, lora_targets(paths, [b.linears for b in spec.blocks]), 4, 4.0, seed=1)
    with torch.no_grad():
        for _, a in lora.items():
            a.B.normal_(0, 0.1, generator=g)                     # not a no-op: B feeds the gradients of A
    reference = micro_loss(model, spec, cfg, latents, contexts, 5, "cpu")
    reference.backward()
    expected = {p: (a.A.grad.clone(), a.B.grad.clone()) for p, a in lora.items()}
    x0, noise, t, context = micro_batch_inputs(cfg, spec, latents, contexts, 5)
    for bounds in splits:
        for _, a in lora.items():
            a.A.grad = a.B.grad = None
        stages = [stage_module(model, spec, r) for r in stage_ranges(bounds)]
        pred, cuts = _chain(stages, dict(x=noisy(x0, noise, t), timestep=t * spec.timestep_scale, context=context))
        loss = flow_loss(pred.float(), x0, noise, t, cfg.weighting)
        _backward(loss, cuts)
        torch.testing.assert_close(loss, reference, rtol=1e-6, atol=0)
        for path, a in lora.items():
            for got, want in ((a.A.grad, expected[path][0]), (a.B.grad, expected[path][1])):
                assert float((got - want).norm() / want.norm()) < 1e-6, (bounds, path)


def test_a_rank_holds_only_its_share_and_its_lora_starts_as_attach_lora_starts_it(comfy):
    from comfy_bridge import build_random
    from ugpum.arch import get_spec
    from ugpum.distributed.stage_lora import lora_params, stage_lora
    from ugpum.distributed.stages import StageRange, keep_only
    from ugpum.train.config import load_config
    from ugpum.compute.lora import attach_lora, lora_targets
    cfg = load_config("tiny-flux2", overrides=dict(devices=["cpu"]))
    spec = get_spec(cfg.model)
    whole = build_random(spec, torch.float32, seed=0)
    everything = attach_lora(whole, lora_targets([b.path for b in spec.blocks], [b.linears for b in spec.blocks]),
                             cfg.rank, cfg.alpha, seed=cfg.seed)
    model = build_random(spec, torch.float32, seed=0)
    keep_only(model, spec, StageRange(2, 4, first=False, last=False))
    names = {n.split(".")[0] for n, _ in model.named_parameters()}
    assert "img_in" not in names and "final_layer" not in names and "time_in" in names
    blocks = {".".join(n.split(".")[:2]) for n, _ in model.named_parameters() if n.split(".")[0].endswith("blocks")}
    assert blocks == {"single_blocks.0", "single_blocks.1"}                # blocks 2 and 3 of the order
    lora = stage_lora(model, cfg, spec, StageRange(2, 4, first=False, last=False))
    mine = dict(lora_params(lora))
    assert {".".join(n.split(".")[:2]) for n in mine} == blocks
    for path, a in everything.items():
        if f"{path}.A" in mine:
            torch.testing.assert_close(mine[f"{path}.A"], a.A, rtol=0, atol=0)


# ------------------------------------------------------------------------------------ torchrun jobs

def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("UGPUM_DEBUG", None)
    return env


def torchrun(ranks: int, *args: str, check: bool = True, **popen) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
           "-m", "ugpum", "train", *args, "--distributed"]
    if popen:
        return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, **popen)
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    if check:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done


def torchrun_schedule(tmp_path: Path, ranks: int, schedule: str, *args: str) -> subprocess.CompletedProcess:
    """`torchrun ... -m ugpum train ... --schedule SCHEDULE --distributed`."""
    return torchrun(ranks, *args, "--schedule", schedule)


def single_process(out: Path, *args: str) -> Path:
    """`python -m ugpum train` itself, through its `main` in this process (one thread, as each rank runs);
    its output beside the folder, in <out>.log."""
    done = main_here("train", *args, "--out", str(out))
    assert done.returncode == 0, done.stderr[-4000:]
    out.with_suffix(".log").write_text(done.stdout)
    return out / "ugpum_lora.safetensors"


def validation_lines(text: str) -> list[str]:
    lines = [line for line in text.splitlines() if line.startswith("validation loss")]
    assert len(lines) == 2, text[-3000:]
    return lines


def assert_same_lora(a: Path, b: Path, tolerance: float = 1e-6) -> float:
    x, y = load_file(str(a)), load_file(str(b))
    assert x.keys() == y.keys()
    worst = max(float((x[k] - y[k]).norm() / max(float(x[k].norm()), 1e-30)) for k in x)
    assert worst < tolerance, worst
    return worst


@pytest.fixture(scope="module")
def two_shapes(tmp_path_factory) -> Path:
    """Six captioned images in two aspect ratios: two buckets, so one step mixes static shapes."""
    from PIL import Image
    data = tmp_path_factory.mktemp("two_shapes")
    for i, src in enumerate(sorted(DATASET.glob("*.jpg"))[:6]):
        image = Image.open(src).convert("RGB")
        if i % 2:
            image = image.resize((1024, 576))
        image.save(data / f"img_{i}.png")
        (data / f"img_{i}.txt").write_text((DATASET / f"{src.stem}.txt").read_text())
    return data


@pytest.fixture(scope="module")
def two_shapes_reference(tmp_path_factory, two_shapes) -> tuple[list[str], Path]:
    """(arguments, single-process run folder) of 3 steps of 3 micro-batches over `two_shapes`, the
    reference of both two-rank tests below."""
    args = common(two_shapes, "tiny-flux2", steps=3, grad_accum=3, schedule="1f1b")
    one = tmp_path_factory.mktemp("two_shapes_reference") / "one"
    single_process(one, *args)
    return args, one


def common(dataset: Path, profile: str, steps: int, grad_accum: int, schedule: str = "auto") -> list[str]:
    return ["--profile", profile, "--dataset", str(dataset), "--devices", "cpu", "--steps", str(steps),
            "--grad-accum", str(grad_accum), "--sample-every", "0", "--schedule", schedule]


@pytest.mark.slow
def test_two_stages_on_two_ranks_train_the_single_process_lora(tmp_path, two_shapes_reference):
    """2 ranks, 1F1B, buckets of two shapes in one step (a stage and schedule per shape): the LoRA,
    the logged losses and the checkpoint are the single-process run's."""
    args, one = two_shapes_reference
    run = torchrun(2, *args, "--out", str(tmp_path / "two"))
    assert "blocks [0, 2), [2, 5), gloo" in run.stdout
    assert_same_lora(one / "ugpum_lora.safetensors", tmp_path / "two" / "ugpum_lora.safetensors")
    same_records(one, tmp_path / "two", steps=3)
    assert validation_lines(run.stdout) == validation_lines(one.with_suffix(".log").read_text())
    assert (tmp_path / "two" / "checkpoints" / "step_000003" / "optimizer.safetensors").is_file()
    plan = json.loads((tmp_path / "two" / "plan.json").read_text())
    assert plan["distributed"] == {"stages": 2, "stages_per_rank": 1, "replicas": 1, "ranks": 2,
                                   "bounds": [[0, 2], [2, 5]]}


def same_records(one: Path, many: Path, steps: int) -> None:
    """metrics.jsonl of the distributed run: the single process's kinds of records, one per step, the
    same losses (< 1e-6) and learning rates."""
    a, b = ([json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (one, many))
    assert [m["step"] for m in b] == list(range(1, steps + 1)) == [m["step"] for m in a]
    assert all(x.keys() == y.keys() and x["lr"] == y["lr"] for x, y in zip(a, b))
    assert all(abs(x["loss"] - y["loss"]) < 1e-6 * abs(x["loss"]) for x, y in zip(a, b))


@pytest.mark.slow
def test_interleaved_1f1b_holds_two_stages_per_rank_and_trains_the_single_process_lora(tmp_path,
                                                                                      two_shapes_reference):
    """2 ranks of 2 stages each (rank 0: stages 0 and 2, rank 1: 1 and 3), buckets of two shapes in
    one step (runs of 1 to 3 micro-batches, each its own interleaved schedule): the LoRA, losses and
    validation losses of the single process; no samples, said once."""
    args, one = two_shapes_reference
    run = torchrun_schedule(tmp_path, 2, "interleaved-1f1b", *args, "--out", str(tmp_path / "two"),
                            "--sample-every", "2")
    assert "2 ranks of 2 stages (rank 0: 0 and 2; rank 1: 1 and 3)" in run.stdout, run.stdout[-3000:]
    bounds = re.search(r"blocks \[0, (\d+)\), \[\1, (\d+)\), \[\2, (\d+)\), \[\3, 5\), gloo", run.stdout)
    assert bounds and 0 < int(bounds[1]) < int(bounds[2]) < int(bounds[3]) < 5, run.stdout[-3000:]   # the planner's 4 stages
    worst = assert_same_lora(one / "ugpum_lora.safetensors", tmp_path / "two" / "ugpum_lora.safetensors")
    print(f"interleaved-1f1b: relative difference {worst}")
    same_records(one, tmp_path / "two", steps=3)
    assert validation_lines(run.stdout) == validation_lines(one.with_suffix(".log").read_text())
    assert run.stdout.count("samples: a distributed run renders none (sample_every = 2 is ignored)") == 1
    assert not (tmp_path / "two" / "samples").exists()
    plan = json.loads((tmp_path / "two" / "plan.json").read_text())
    assert plan["distributed"]["stages"] == 4 and plan["distributed"]["stages_per_rank"] == 2


@pytest.mark.slow
def test_zero_bubble_on_two_replicas_then_resumed_on_one_trains_the_single_process_lora(tmp_path):
    """Zero bubble (ZB-V: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2; each backward split into
    the input's and the LoRA's part): 2 steps on 2 replicas (4 ranks), then resumed on 1 replica (2
    ranks) to step 4: the uninterrupted single process's LoRA, losses and validation losses."""
    args = common(DATASET, "tiny-flux2", steps=2, grad_accum=4, schedule="1f1b")
    out = tmp_path / "many"
    first = torchrun_schedule(tmp_path, 4, "zero-bubble", *args, "--data-parallel", "2", "--out", str(out))
    assert "2 ranks of 2 stages (rank 0: 0 and 3; rank 1: 1 and 2) x 2 replica(s)" in first.stdout
    more = common(DATASET, "tiny-flux2", steps=4, grad_accum=4, schedule="1f1b")
    second = torchrun_schedule(tmp_path, 2, "zero-bubble", *more, "--resume", str(out))
    assert f"resumed from {out / 'checkpoints' / 'step_000002'} at step 2" in second.stdout
    reference = single_process(tmp_path / "one", *more)
    print(f"zero-bubble, resumed 2 -> 1 replicas: relative difference "
          f"{assert_same_lora(reference, out / 'ugpum_lora.safetensors')}")
    same_records(tmp_path / "one", out, steps=4)
    assert validation_lines(second.stdout)[1] == validation_lines((tmp_path / "one.log").read_text())[1]


@pytest.mark.slow
@pytest.mark.parametrize("profile, ranks, replicas, schedule", [     # with the test above: each family with
    ("tiny-flux2", 4, 2, "gpipe"),                                    # each schedule and both layouts
    ("tiny-wan", 2, 1, "gpipe"),
    ("tiny-wan", 4, 2, "1f1b"),
])
def test_pipeline_and_replicas_train_the_single_process_lora(tmp_path, profile, ranks, replicas, schedule):
    args = common(DATASET, profile, steps=3, grad_accum=4, schedule=schedule)
    reference = single_process(tmp_path / "one", *args)
    torchrun(ranks, *args, "--data-parallel", str(replicas), "--out", str(tmp_path / "many"))
    assert_same_lora(reference, tmp_path / "many" / "ugpum_lora.safetensors")


@pytest.mark.slow
def test_two_ranks_of_one_stage_train_the_single_process_lora(tmp_path):
    """Plain data parallel (issue 40): --data-parallel R with R = the ranks, each rank a whole copy of the
    model; the LoRA is one device's with the same global batch, and the one-process replicas' too."""
    args = common(DATASET, "tiny-flux2", steps=3, grad_accum=4)
    reference = single_process(tmp_path / "one", *args)
    replicas = single_process(tmp_path / "replicas", *args[:4], "--devices", "cpu,cpu", "--replicas", "2", *args[6:])
    run = torchrun(2, *args, "--data-parallel", "2", "--out", str(tmp_path / "many"))
    assert "distributed: 2 ranks = 1 stages x 2 replica(s), blocks [0, 5), gloo" in run.stdout
    assert assert_same_lora(reference, tmp_path / "many" / "ugpum_lora.safetensors") == 0.0
    assert assert_same_lora(replicas, tmp_path / "many" / "ugpum_lora.safetensors") == 0.0
    plan = json.loads((tmp_path / "many" / "plan.json").read_text())
    assert plan["distributed"] == {"stages": 1, "stages_per_rank": 1, "replicas": 2, "ranks": 2, "bounds": [[0, 5]]}


def _rank_pid(parent: int, rank: int) -> int | None:
    """The pid of torchrun's worker of `rank` (its children carry RANK in their environment)."""
    try:
        children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    except OSError:
        return None
    for child in children:
        try:
            env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return int(child)
    return None


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds torchrun's workers through /proc")
def test_a_sigterm_to_one_rank_stops_every_rank_with_a_checkpoint_that_resumes_exactly(tmp_path):
    out = tmp_path / "run"
    args = common(DATASET, "tiny-flux2", steps=400, grad_accum=2)
    job = torchrun(2, *args, "--out", str(out), start_new_session=True)
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
            assert job.poll() is None and time.monotonic() < deadline, job.stdout.read() if job.poll() else "timeout"
            time.sleep(0.2)
        pid = _rank_pid(job.pid, 1)
        assert pid is not None
        os.kill(pid, signal.SIGTERM)                     # a real signal to one worker, not to torchrun
        output, _ = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    stopped = [line for line in output.splitlines() if "stopped by SIGTERM" in line]
    assert sorted(line.split(":")[0] for line in stopped) == ["rank 0", "rank 1"], output[-4000:]
    assert all("on rank 1 after step" in line and f"--resume {out}" in line for line in stopped)
    assert not any(line.startswith("[rank") for line in output.splitlines()), output[-4000:]   # no rank's traceback
    step = int(stopped[0].split("after step ")[1].split(":")[0])
    from ugpum.train.run.checkpoint import latest_checkpoint
    assert latest_checkpoint(out).name == f"step_{step:06d}"
    assert (out / f"ugpum_lora_step{step}.safetensors").is_file()
    # resumed with another number of replicas (2 stages x 2), to two steps past the stop
    more = common(DATASET, "tiny-flux2", steps=step + 2, grad_accum=2)
    torchrun(4, *[a for a in more], "--data-parallel", "2", "--resume", str(out))
    reference = single_process(tmp_path / "one", *more)
    assert_same_lora(reference, out / "ugpum_lora.safetensors")
    logged = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, step + 3))


def test_distributed_flags_need_torchrun(tmp_path, capsys):
    from ugpum.commands import main
    base = ["train", "--profile", "tiny-flux2", "--dataset", str(DATASET), "--devices", "cpu", "--steps", "1",
            "--out", str(tmp_path / "x")]
    for var in ("RANK", "WORLD_SIZE"):
        assert var not in os.environ
    assert main(base + ["--data-parallel", "2"]) == 2
    assert "--data-parallel needs --distributed" in capsys.readouterr().err
    assert main(base + ["--distributed"]) == 2
    assert "runs under torchrun" in capsys.readouterr().err


def test_plan_forecasts_a_distributed_run_and_says_when_one_process_is_better(capsys):
    from ugpum.commands import main
    base = ["plan", "--model", "flux2-klein-9b", "--gpu", "rtx4090", "--gpu", "rtx4090", "--distributed"]
    assert main(base) == 0                                           # one machine, one replica: the same plan
    text = capsys.readouterr().out
    assert "per rank" in text and "The single process is the better choice" in text
    assert main(base + ["--nodes", "2", "--grad-accum", "4", "--json"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert (two["stages"], two["replicas"], len(two["rank_gib"])) == (2, 2, 2)
    assert two["allreduce_s"] > 0 and two["network_s"] == 0 and two["single_step_s"] > two["step_s"]
    assert two["verdict"].startswith("Distributed is")
    # a pipeline over both machines sends the hidden state over the network; a slow one loses
    assert main(base + ["--nodes", "2", "--grad-accum", "4", "--data-parallel", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["network_s"] > 0
    assert main(base + ["--nodes", "2", "--grad-accum", "4", "--network-gbps", "0.1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"].startswith("The single process is the better choice")
    assert main(base + ["--nodes", "2", "--grad-accum", "3"]) == 2                 # 3 micro-batches, 2 replicas
    assert "multiple of the 2 replicas" in capsys.readouterr().err
    # replicas of one stage: one machine of two GPUs, and splits x replicas over machines still
    assert main(base + ["--grad-accum", "2", "--data-parallel", "2", "--json"]) == 0
    one_machine = json.loads(capsys.readouterr().out)
    assert (one_machine["stages"], one_machine["replicas"], one_machine["network_s"]) == (1, 2, 0)
    assert one_machine["step_s"] > 0 and one_machine["verdict"].startswith("The single process is the better choice")
    assert main(base + ["--nodes", "2", "--grad-accum", "4", "--data-parallel", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stages"] == 1
    assert main(base + ["--grad-accum", "3", "--data-parallel", "3"]) == 2
    assert "cannot form 3 replica(s) of a pipeline" in capsys.readouterr().err


def test_a_rank_takes_nccl_and_its_own_gpu_where_cuda_is_here_and_gloo_on_the_cpu():
    """The choice `init_distributed` makes, from what torchrun and torch say (no GPU needed)."""
    from ugpum.distributed.topology import process_group_choice
    from ugpum.train.errors import TrainingError
    assert process_group_choice(True, 0) == ("nccl", "cuda:0")
    assert process_group_choice(True, 3, ["auto"], 4) == ("nccl", "cuda:3")              # cuda:LOCAL_RANK
    assert process_group_choice(True, 1, ["cuda:2", "cuda:3"], 2) == ("nccl", "cuda:3")  # the GPUs named
    assert process_group_choice(False, 1, ["auto"], 2) == ("gloo", "cpu")                # no CUDA here
    assert process_group_choice(True, 1, ["cpu"], 2) == ("gloo", "cpu")                  # --devices cpu
    with pytest.raises(TrainingError, match="names 1 GPU"):
        process_group_choice(True, 1, ["cuda:0"], 2)


def test_two_stages_per_rank_are_placed_planned_and_refused_in_one_process():
    from ugpum.arch import Workload, get_spec
    from ugpum.planning.devices import resolve_devices
    from ugpum.distributed.forecast import forecast_distributed
    from ugpum.distributed.schedules import rank_stages
    from ugpum.train.config import load_config
    from ugpum.train.errors import TrainingError
    from ugpum.train.prepare import plan_for
    assert [rank_stages("interleaved-1f1b", r, 4) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [rank_stages("zero-bubble", r, 4) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [rank_stages("1f1b", r, 2) for r in range(2)] == [[0], [1]]
    spec = get_spec("flux2-klein-9b")
    gpus = resolve_devices(["rtx4090", "rtx4090"], spec, probe=False)
    w = Workload(width=1024, height=1024, frames=1, batch=1, rank=16, checkpointing=True, held_dtype="bf16")
    one = forecast_distributed(spec, gpus, w, 4, nodes=2)
    two = forecast_distributed(spec, gpus, w, 4, nodes=2, schedule="zero-bubble")
    assert (two.stages, two.stages_per_rank, two.rank_stages) == (2, 2, [[0, 3], [1, 2]])
    assert [s.blocks for s in two.plan.stages] == [[0, 8], [8, 16], [16, 24], [24, 32]]
    assert two.pipeline_s < one.pipeline_s                           # the smaller bubble
    assert sum(two.rank_gib) == pytest.approx(sum(one.rank_gib), rel=0.1)
    cfg = load_config("tiny-flux2", overrides={"devices": ["cpu"]})
    cfg.schedule = "zero-bubble"
    with pytest.raises(TrainingError, match="two pipeline stages on each rank of a distributed run"):
        plan_for(cfg)


def test_one_loop_drives_both_engines_compile_and_8bit_included(tmp_path):
    """The distributed run goes through the one training loop with every setting: compile = on
    compiles each rank's blocks (the log says so, and the LoRA equals the eager single process to
    float tolerance), and base_compute = fp8 on the CPU is refused by name before any work. One bucket
    shape and one step keep the compiling short."""
    from PIL import Image
    from ugpum.train import loop
    from ugpum.distributed.stepper import TorchrunRankStepper
    assert loop.OneProcessStepper is not TorchrunRankStepper      # two steppers, one `train`
    data = tmp_path / "data"
    data.mkdir()
    for i, src in enumerate(sorted(DATASET.glob("*.jpg"))[:2]):
        Image.open(src).convert("RGB").resize((512, 512)).save(data / f"img_{i}.png")
        (data / f"img_{i}.txt").write_text((DATASET / f"{src.stem}.txt").read_text())
    args = common(data, "tiny-flux2", steps=1, grad_accum=2, schedule="1f1b")
    refused = torchrun(2, *args, "--out", str(tmp_path / "fp8"), "--base-compute", "fp8", check=False)
    assert refused.returncode != 0
    said = refused.stdout + refused.stderr
    assert "error: base_compute=fp8 needs an NVIDIA GPU" in said
    assert f'File "{ROOT / "ugpum"}' not in said                   # a sentence, not our traceback (torchrun adds its own)
    assert not (tmp_path / "fp8" / "metrics.jsonl").exists()
    # (base_compute = auto: the plan's choice, bf16 on the CPU, as one process resolves it)
    compiled = torchrun(2, *args, "--out", str(tmp_path / "compiled"), "--compile", "on", "--base-compute", "auto")
    assert "compile=on:" in compiled.stdout + compiled.stderr
    reference = single_process(tmp_path / "one", *args)
    assert_same_lora(reference, tmp_path / "compiled" / "ugpum_lora.safetensors", tolerance=1e-4)
