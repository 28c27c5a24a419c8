"""The training engine on tiny models (CPU): learning, exact resume, split = unsplit, cache, errors,
and the written LoRA loading through ComfyUI's own LoRA code."""
import json
import shutil
import traceback
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from comfy_bridge import find_comfyui
from ugpum.train.run.checkpoint import latest_checkpoint
from ugpum.train.config import ConfigError, load_config
from ugpum.train.dataset import DatasetError
from ugpum.train.batches import MicroBatches
from ugpum.train.objective import validation_picks
from ugpum.train.stopping import Stop
from ugpum.commands.train import run_training as train

pytestmark = pytest.mark.skipif(find_comfyui() is None, reason="needs ComfyUI's model classes")
DATASET = Path(__file__).resolve().parents[2] / "demo_datasets" / "loranne"
QUIET = dict(log=lambda *a: None)


def cfg(profile="tiny-flux2", **kw):
    base = dict(dataset=str(DATASET), devices=["cpu"], trigger="loranne", sample_every=0)
    base.update(kw)
    return load_config(profile, overrides=base)


def lora_tensors(path):
    return load_file(str(path))


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    return train(cfg(steps=50, save_every=10), out, **QUIET), out


@pytest.mark.slow
def test_loss_falls_clearly_over_50_steps(full_run):
    result, out = full_run
    assert result.validation_after < 0.9 * result.validation_before
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == list(range(1, 51))
    assert all({"step", "loss", "seconds"} <= set(l) for l in lines)


@pytest.mark.slow
def test_output_folder_holds_lora_metrics_and_checkpoints(full_run):
    result, out = full_run
    tensors = lora_tensors(result.lora_path)
    assert any(k.startswith("diffusion_model.double_blocks.0.img_attn.qkv.lora_A") for k in tensors)
    assert latest_checkpoint(out).name == "step_000050"
    assert not list(out.glob("**/.tmp*"))


@pytest.mark.slow
def test_interrupted_then_resumed_run_ends_with_the_same_lora(full_run, tmp_path):
    reference, _ = full_run
    calls = {"n": 0}

    def interrupt_at_step_23():
        calls["n"] += 1
        if calls["n"] > 23:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as stopped:
        train(cfg(steps=50, save_every=10), tmp_path, check_interrupt=interrupt_at_step_23, **QUIET)
    assert latest_checkpoint(tmp_path).name == "step_000023"       # saved on the way out
    assert (tmp_path / "ugpum_lora_step23.safetensors").is_file()
    stop = Stop.of(stopped.value)                                   # what the stop says it kept
    assert (stop.why, stop.saved, stop.lora, stop.told) == \
        (stopped.value, 23, tmp_path / "ugpum_lora_step23.safetensors", True)
    resumed = train(cfg(steps=50, save_every=10), tmp_path, resume=True, **QUIET)
    a, b = lora_tensors(reference.lora_path), lora_tensors(resumed.lora_path)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    steps = [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 51))


def test_adamw8bit_learns_and_resumes_exactly(tmp_path):
    """bitsandbytes' 8-bit AdamW (its CPU backend here): its state, quantisation maps shared between
    parameters included, goes into the checkpoint and back."""
    pytest.importorskip("bitsandbytes")
    settings = dict(steps=8, optimizer="adamw8bit", save_every=4, rank=32)     # rank 32: 8-bit states
    reference = train(cfg(**settings), tmp_path / "ref", **QUIET)
    assert reference.validation_after < reference.validation_before
    calls = {"n": 0}

    def interrupt_at_step_5():
        calls["n"] += 1
        if calls["n"] > 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(cfg(**settings), tmp_path / "run", check_interrupt=interrupt_at_step_5, **QUIET)
    state = load_file(str(latest_checkpoint(tmp_path / "run") / "optimizer.safetensors"))
    assert any(k.endswith("::state1") and t.dtype == torch.uint8 for k, t in state.items())
    resumed = train(cfg(**settings), tmp_path / "run", resume=True, **QUIET)
    a, b = lora_tensors(reference.lora_path), lora_tensors(resumed.lora_path)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


def test_validation_takes_distinct_samples_spread_over_the_dataset():
    from ugpum.train.dataset import ImageItem
    from ugpum.train.video import ClipItem
    repeated = [ImageItem(Path(f"{n}.png"), "", (64, 64)) for n in range(3) for _ in range(4)]
    assert validation_picks(repeated) == [0, 4, 8]                      # num_repeats = 4: each once
    lengths = [ClipItem(Path("a.mp4"), "", (64, 64), 1, f) for f in (1, 1, 17, 17)]
    assert validation_picks(lengths) == [0, 2]                          # a clip at two target_frames
    many = [ImageItem(Path(f"{n}.png"), "", (64, 64)) for n in range(31)]
    assert validation_picks(many) == list(range(0, 31, 2))              # 16 of 31, first to last


def test_micro_batches_group_items_of_one_shape():
    one = MicroBatches([("a",)] * 5, batch=1, seed=3)
    shuffle = torch.randperm(5, generator=torch.Generator().manual_seed(3 * 1_000_003)).tolist()
    assert [one(k) for k in range(5)] == [[i] for i in shuffle]          # batch 1: the epoch's shuffle
    shapes = [("wide",)] * 5 + [("tall",)] * 2
    two = MicroBatches(shapes, batch=2, seed=3)
    assert two.per_epoch == 3 + 1                                        # 5 wide: 2 + 2 + 1, 2 tall: 2
    for epoch in range(3):
        groups = [two(epoch * two.per_epoch + j) for j in range(two.per_epoch)]
        assert sorted(i for g in groups for i in g) == list(range(7))    # every item once an epoch
        assert all(len(g) <= 2 and len({shapes[i] for i in g}) == 1 for g in groups)
    assert [two(k) for k in range(4)] != [two(k) for k in range(4, 8)]   # a new shuffle each epoch


def test_a_batch_of_two_is_the_mean_of_its_samples(comfy):
    """micro_loss stacks latents and text contexts; each sample's loss is what it would be alone."""
    from comfy_bridge import build_random
    from ugpum.arch import get_spec
    from ugpum.diffusion.flow import flux2_image_seq_len, sample_timesteps
    from ugpum.train.objective import loss_at, micro_loss, model_context
    spec, config = get_spec("tiny-flux2"), cfg(resolution=64)
    model = build_random(spec, torch.float32, seed=2)
    g = torch.Generator().manual_seed(0)
    latents = [torch.randn(128, 4, 4, generator=g) for _ in range(2)]
    contexts = [torch.randn(n, spec.context_dim, generator=g) for n in (5, 9)]    # padded to one length
    with torch.no_grad():
        batched = micro_loss(model, spec, config, latents, contexts, 7, "cpu")
        draws = torch.Generator().manual_seed((config.seed * 7_919 + 7) % 2**63)
        noise = torch.randn(2, 128, 4, 4, generator=draws)
        t = sample_timesteps(2, config.timesteps, draws, shift=config.shift, image_seq_len=flux2_image_seq_len(64, 64))
        alone = [loss_at(model, spec, config, latents[i][None], noise[i:i + 1], t[i:i + 1],
                         model_context(spec, contexts[i]), "cpu", config.weighting) for i in range(2)]
    torch.testing.assert_close(batched, (alone[0] + alone[1]) / 2, rtol=1e-5, atol=1e-6)


def test_batch_of_two_trains_and_is_planned_for(tmp_path):
    result = train(cfg(steps=12, batch=2), tmp_path, **QUIET)
    assert result.validation_after < result.validation_before
    assert result.plan.workload["batch"] == 2
    with pytest.raises(ConfigError, match="'batch' = 0"):
        cfg(batch=0)


def test_split_over_two_devices_gives_the_same_lora(tmp_path):
    one = train(cfg(steps=6), tmp_path / "one", **QUIET)
    two = train(cfg(steps=6, devices=["cpu", "cpu"]), tmp_path / "two", **QUIET)
    assert [s.blocks for s in two.plan.stages][0][1] < 5                # really two stages
    a, b = lora_tensors(one.lora_path), lora_tensors(two.lora_path)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-6, atol=1e-7)


HOST_READS = ("item", "tolist", "__float__", "__bool__", "__int__", "__index__")


def test_a_step_reads_the_device_once_however_many_lora_modules_and_micro_batches(tmp_path, monkeypatch):
    """Reading a tensor's value on the host (item, float, bool, int, tolist) is a host sync on a GPU: the host
    waits until the GPU's queue drains. A step reads its micro-batches' losses and its gradients' norm once,
    together, whatever the LoRA's size. The optimizer reads nothing: its fused kernel keeps the step counts beside
    the parameters (the unfused AdamW reads 2 a parameter a step, from the host, where it keeps them)."""
    sites, counting = [], [False]

    def counted(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            if counting[0]:
                frame = traceback.extract_stack(limit=2)[0]
                sites.append(f"{name} at {Path(frame.filename).name}:{frame.lineno}")
            return original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, read)
    for name in HOST_READS:
        counted(name)

    def on_step(step, steps, _loss):              # the reads of steps 2..4, not the saves and validation after
        counting[0] = step < steps
    reads = {}
    for targets in ([], ["img_attn.qkv"]):        # every Linear (22), then 2
        sites.clear()
        # 4 steps of 2 micro-batches stay in the first epoch of 10 items, whose shuffle is drawn before them
        result = train(cfg(steps=4, grad_accum=2, save_every=0, targets=targets), tmp_path / str(len(targets)),
                       on_step=on_step, **QUIET)
        assert result.steps_done == 4
        reads[sum(".lora_A." in k for k in lora_tensors(result.lora_path))] = list(sites)
    assert len(reads) == 2                         # two LoRA sizes
    for modules, found in reads.items():
        assert len(found) == 3, f"{modules} LoRA modules: {len(found)} host reads in 3 steps: {found}"


def test_a_steps_first_inputs_are_made_before_the_step_before_waits_for_the_device(tmp_path, monkeypatch):
    """The loop asks for the next step's first micro-batch before it waits for the device, so the host draws its
    noise and sends it to the GPU while the GPU still runs the step; the step then takes those inputs instead of
    making them again. With the fused AdamW a step is read only once the next one is under way (its micro-batches
    made and sent): the host never makes the GPU wait between steps. The last step is read at once."""
    from ugpum.train import divergence, loop, stepper
    events, make, read = [], stepper.micro_batch_inputs, divergence.StepReading.read
    monkeypatch.setattr(stepper, "micro_batch_inputs", lambda *a, **kw: events.append(f"made {a[4]}") or make(*a, **kw))
    monkeypatch.setattr(divergence.StepReading, "read", lambda self: events.append(f"read {self.step}") or read(self))
    train(cfg(steps=3, grad_accum=2, save_every=0), tmp_path, **QUIET)
    assert events == ["made 0", "made 1", "made 2", "made 3", "made 4", "read 1", "made 5", "read 2", "read 3"]
    assert loop.skips_on_device(loop.make_optimizer(cfg(), [torch.nn.Parameter(torch.ones(1))]))


def test_a_step_that_is_not_finite_leaves_the_lora_of_the_step_before_though_it_is_read_late(tmp_path, monkeypatch):
    """Step 3's loss turns NaN. Its values are read while step 4 runs, so the fused AdamW was told on the device to
    skip it: the run stops naming step 3, and what it keeps (the LoRA and checkpoint of step 2, the metrics of
    steps 1 and 2) is bit for bit what a run of 2 steps keeps."""
    from ugpum.train import stepper
    from ugpum.train.divergence import NonFiniteStep
    clean = train(cfg(steps=2, save_every=0), tmp_path / "clean", **QUIET)
    calls, loss_at = [0], stepper.loss_at

    def third_is_nan(*args, **kwargs):
        calls[0] += 1
        loss = loss_at(*args, **kwargs)
        return loss * float("nan") if calls[0] == 3 else loss
    monkeypatch.setattr(stepper, "loss_at", third_is_nan)
    with pytest.raises(NonFiniteStep, match="step 3: the loss is nan, so the run stopped before applying it") as caught:
        train(cfg(steps=5, save_every=0), tmp_path / "nan", **QUIET)
    assert calls[0] == 4                            # step 4's forward and backward ran before step 3 was read
    assert Stop.of(caught.value).saved == 2
    kept, want = lora_tensors(tmp_path / "nan" / "ugpum_lora_step2.safetensors"), lora_tensors(clean.lora_path)
    assert kept.keys() == want.keys() and all(torch.equal(kept[k], want[k]) for k in want)
    assert latest_checkpoint(tmp_path / "nan").name == "step_000002"
    steps = [json.loads(line)["step"] for line in (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


def test_a_signal_while_a_step_is_applied_keeps_that_step_and_one_while_it_is_read_on_the_way_out_waits(
        tmp_path, monkeypatch):
    """A real SIGTERM that lands inside the optimizer's step is held until the step is applied, counted and kept
    to be read: the run stops with step 3 saved and logged. A real Ctrl-C that lands while a stopping run reads
    its last step is noted, and the save still comes."""
    import os
    import signal
    from ugpum.train import divergence, loop
    make = loop.make_optimizer

    def optimizer_signalled_at_3(*args):
        optimizer, steps = make(*args), [0]
        real_step = optimizer.step

        def step(*a, **kw):
            steps[0] += 1
            if steps[0] == 3:
                os.kill(os.getpid(), signal.SIGTERM)
            return real_step(*a, **kw)
        optimizer.step = step
        return optimizer
    monkeypatch.setattr(loop, "make_optimizer", optimizer_signalled_at_3)
    said = []
    with pytest.raises(KeyboardInterrupt) as caught:
        train(cfg(steps=5, save_every=0), tmp_path / "term", log=said.append)
    assert Stop.of(caught.value).saved == 3 and latest_checkpoint(tmp_path / "term").name == "step_000003"
    steps = [json.loads(line)["step"] for line in (tmp_path / "term" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    monkeypatch.setattr(loop, "make_optimizer", make)

    read, checks = divergence.StepReading.read, [0]

    def cancel_at_4():
        checks[0] += 1
        if checks[0] == 4:                          # ComfyUI's Cancel at the top of step 4: step 3 is not read yet
            raise KeyboardInterrupt

    def read_after_a_second_ctrl_c(self):
        if checks[0] >= 4:
            os.kill(os.getpid(), signal.SIGINT)
        return read(self)
    monkeypatch.setattr(divergence.StepReading, "read", read_after_a_second_ctrl_c)
    said.clear()
    with pytest.raises(KeyboardInterrupt) as caught:
        train(cfg(steps=5, save_every=0), tmp_path / "cancel", check_interrupt=cancel_at_4, log=said.append)
    assert Stop.of(caught.value).saved == 3 and latest_checkpoint(tmp_path / "cancel").name == "step_000003"
    assert any("SIGINT: finishing the save first" in str(line) for line in said), said


def test_second_run_hits_the_cache(tmp_path):
    cache = tmp_path / "cache"
    first = train(cfg(steps=1, cache_dir=str(cache)), tmp_path / "a", **QUIET)
    second = train(cfg(steps=1, cache_dir=str(cache)), tmp_path / "b", **QUIET)
    assert first.cache_misses == 20 and first.cache_hits == 0        # 10 latents + 10 captions
    assert second.cache_hits == 20 and second.cache_misses == 0
    # a changed caption is a new key; the image latents stay valid
    data = tmp_path / "data"
    shutil.copytree(DATASET, data)
    (data / "loranne_01.txt").write_text("loranne, something else entirely")
    third = train(cfg(steps=1, cache_dir=str(cache), dataset=str(data)), tmp_path / "c", **QUIET)
    assert third.cache_misses == 1 and third.cache_hits == 19


def test_tiny_wan_trains(tmp_path):
    result = train(cfg(profile="tiny-wan", steps=3), tmp_path, **QUIET)
    assert result.steps_done == 3 and result.lora_path.is_file()
    assert any(".self_attn.q.lora_A" in k for k in lora_tensors(result.lora_path))


@pytest.mark.parametrize("setup, error, message", [
    (lambda d: None, DatasetError, "no images"),
    (lambda d: (d / "a.png").write_bytes(b"not a png"), DatasetError, "a.png"),
])
def test_bad_dataset_errors_name_the_file_and_leave_no_lora(tmp_path, setup, error, message):
    data = tmp_path / "data"
    data.mkdir()
    setup(data)
    if (data / "a.png").exists():
        (data / "a.png.txt").write_text("x")
        (data / "a.txt").write_text("caption")
    with pytest.raises(error, match=message):
        train(cfg(steps=2, dataset=str(data)), tmp_path / "out", **QUIET)
    assert not list((tmp_path / "out").glob("*.safetensors"))


def test_missing_caption_is_named(tmp_path):
    data = tmp_path / "data"
    shutil.copytree(DATASET, data)
    (data / "loranne_03.txt").unlink()
    with pytest.raises(DatasetError, match="loranne_03"):
        train(cfg(steps=1, dataset=str(data)), tmp_path / "out", **QUIET)


@pytest.mark.parametrize("override, name", [({"rank": 0}, "rank"), ({"lr_schedule": "linearish"}, "lr_schedule"),
                                            ({"output_name": "../x"}, "output_name"), ({"typo_key": 1}, "typo_key")])
def test_bad_settings_name_the_setting(override, name):
    with pytest.raises(ConfigError, match=name):
        load_config("tiny-flux2", overrides=override)


def test_lora_loads_through_comfyui_and_patched_forward_matches(full_run):
    """ComfyUI's own LoRA key mapping and weight patching reproduce the trained forward."""
    import comfy.lora
    from comfy_bridge import build_random
    from ugpum.arch import get_spec
    from ugpum.compute.lora import attach_lora, lora_targets
    result, _ = full_run
    spec = get_spec("tiny-flux2")
    c = cfg(steps=50)
    model = build_random(spec, torch.float32, seed=c.seed)
    sd = lora_tensors(result.lora_path)

    class Holder(torch.nn.Module):        # the layout ComfyUI's key map reads: diffusion_model.<path>
        def __init__(self, dm):
            super().__init__()
            self.diffusion_model = dm
    holder = Holder(model)
    key_map = {}
    for k in holder.state_dict():
        if k.endswith(".weight"):
            key_map[k[:-len(".weight")]] = k
    patches = comfy.lora.load_lora(sd, key_map, log_missing=False)
    paths = {k[len("diffusion_model."):].rsplit(".lora_", 1)[0] for k in sd if ".lora_A" in k}
    assert len(patches) == len(paths) == sum(len(b.linears) for b in spec.blocks)   # every key matched

    x = torch.randn(1, 128, 4, 4)
    ctx = torch.randn(1, 16, spec.context_dim)
    t = torch.tensor([0.5])
    # our forward: base + adapters loaded from the file
    lora = attach_lora(model, lora_targets([b.path for b in spec.blocks], [b.linears for b in spec.blocks]),
                       c.rank, c.alpha)
    with torch.no_grad():
        for path, a in lora.items():
            a.A.copy_(sd[f"diffusion_model.{path}.lora_A.weight"])
            a.B.copy_(sd[f"diffusion_model.{path}.lora_B.weight"])
        ours = model(x, t, ctx, transformer_options={})
    lora.remove()
    # ComfyUI's: merge each patch into its weight with ComfyUI's calculate_weight
    with torch.no_grad():
        for key, patch in patches.items():
            owner = holder.get_parameter(key)
            merged = comfy.lora.calculate_weight([(1.0, patch, 1.0, None, None)], owner.data.clone(), key)
            owner.copy_(merged)
        theirs = model(x, t, ctx, transformer_options={})
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5)
    assert (ours - model(x, t, ctx, transformer_options={})).abs().max() < 1e-4


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipelined_accumulation_trains_the_same_lora(tmp_path, schedule):
    seq = train(cfg(steps=3, grad_accum=3, devices=["cpu", "cpu"], schedule="sequential"), tmp_path / "s", **QUIET)
    pipe = train(cfg(steps=3, grad_accum=3, devices=["cpu", "cpu"], schedule=schedule), tmp_path / "p", **QUIET)
    a, b = lora_tensors(seq.lora_path), lora_tensors(pipe.lora_path)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-6, atol=1e-7)


def test_fp8_base_weights_train(tmp_path):
    """Frozen fp8 weights go through ComfyUI's manual-cast ops; the LoRA stays fp32."""
    result = train(cfg(steps=3, weight_dtype="fp8"), tmp_path, **QUIET)
    assert result.steps_done == 3 and all(l == l for l in result.losses)      # finite, not NaN
    assert all(t.dtype == torch.float32 for t in lora_tensors(result.lora_path).values())


def test_bf16_base_weights_train_on_the_cpu(tmp_path):
    """The real models' default weight dtype on a machine without a GPU: bf16 weights under CPU autocast
    (without it their Linears met fp32 inputs: "expected m1 and m2 to have the same dtype")."""
    result = train(cfg(steps=2, weight_dtype="bf16", autocast=True), tmp_path, **QUIET)
    assert result.steps_done == 2 and all(l == l for l in result.losses)
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in lora_tensors(result.lora_path).values())
    with pytest.raises(ConfigError, match=r"setting 'autocast' = False: bf16 weights .* autocast = true"):
        cfg(weight_dtype="bf16", autocast=False)


def test_real_models_refuse_to_train_without_their_encoders(tmp_path, capsys):
    """Without a GPU the CPU refusal comes first (tests/integration/test_cli_journey.py); the sentence about
    the encoders is the one `train` says next, on a GPU machine."""
    from ugpum.commands import main
    from ugpum.commands.errors import UsageError
    from ugpum.commands.train import model_files
    with pytest.raises(UsageError, match="needs its text encoder and VAE"):
        model_files(load_config("klein-9b-1024"), None, None, None, None)
    assert main(["train", "--profile", "klein-9b-1024", "--dataset", str(DATASET), "--out", str(tmp_path)]) == 2
    said = "needs its text encoder and VAE" if torch.cuda.is_available() else "cannot train on the CPU"
    assert said in capsys.readouterr().err


def test_cli_train_writes_the_output_folder(tmp_path, capsys):
    from ugpum.commands import main
    out = tmp_path / "run"
    assert main(["train", "--profile", "tiny-flux2", "--dataset", str(DATASET), "--devices", "cpu",
                 "--steps", "2", "--sample-every", "1", "--out", str(out)]) == 0
    assert (out / "ugpum_lora.safetensors").is_file() and (out / "metrics.jsonl").is_file()
    assert {p.name for p in (out / "samples").iterdir()} >= {"step_00000.png", "step_00002.png", "before_after.png"}
    assert (out / "checkpoints" / "latest.json").is_file()
    assert main(["train", "--profile", "tiny-flux2", "--dataset", str(DATASET)]) == 2      # no --out
    assert "--out" in capsys.readouterr().err


@pytest.mark.parametrize("schedule", ["gpipe", "sequential"])
def test_cli_schedule_flag_picks_the_micro_batch_order(tmp_path, capsys, schedule):
    from ugpum.commands import main
    assert main(["train", "--profile", "tiny-flux2", "--dataset", str(DATASET), "--devices", "cpu,cpu",
                 "--steps", "1", "--grad-accum", "2", "--schedule", schedule, "--sample-every", "0",
                 "--out", str(tmp_path / "run")]) == 0
    assert f"micro-batch schedule: {schedule}" in capsys.readouterr().out


def new_comfyui(tmp_path: Path, monkeypatch) -> Path:
    """A ComfyUI (its source's lines that tell it loads klein 9B's Qwen3-8B) whose models/ folder the run names."""
    from support.comfyui_tree import comfyui_tree
    monkeypatch.delenv("COMFYUI_PATH", raising=False)
    return comfyui_tree(tmp_path / "ComfyUI") / "models"


def test_missing_model_files_are_named_with_the_download_command(tmp_path, monkeypatch):
    """What `train --models DIR` and `demo --models DIR` say, on a GPU machine, when files are missing."""
    from ugpum.commands.errors import UsageError
    from ugpum.commands.train import model_files
    models = new_comfyui(tmp_path, monkeypatch)
    (models / "vae").mkdir(parents=True)
    (models / "vae" / "flux2-vae.safetensors").write_bytes(b"")
    cfg = load_config("klein-9b-1024")
    with pytest.raises(UsageError) as said:
        model_files(cfg, str(models), None, None, None)
    err = str(said.value)
    assert "diffusion_models/flux-2-klein-base-9b.safetensors" in err and "text_encoders/qwen_3_8b_fp8mixed.safetensors" in err
    assert f"python -m ugpum download flux2-klein-base-9b --models {models}" in err and "vae/flux2-vae" not in err
    with pytest.raises(UsageError, match=f"--text-encoder {tmp_path / 'te.safetensors'} \\(no such file\\)"):
        model_files(cfg, str(models), None, str(tmp_path / "te.safetensors"), None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a real model trains only on a CUDA GPU")
def test_demo_on_real_weights_names_missing_files_and_the_download_command(tmp_path, capsys, monkeypatch):
    from ugpum.commands import main
    models = new_comfyui(tmp_path, monkeypatch)
    (models / "diffusion_models").mkdir(parents=True)
    (models / "vae").mkdir()
    (models / "vae" / "flux2-vae.safetensors").write_bytes(b"")
    assert main(["demo", "--models", str(models), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "text_encoders/qwen_3_8b_fp8mixed.safetensors" in err
    assert "diffusion_models/flux-2-klein-base-9b.safetensors" in err
    assert "python -m ugpum download flux2-klein-base-9b" in err and "vae/flux2-vae" not in err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a real model trains only on a CUDA GPU")
def test_cli_train_on_a_models_folder_names_each_missing_file_and_the_download_command(tmp_path, capsys, monkeypatch):
    from ugpum.commands import main
    models = new_comfyui(tmp_path, monkeypatch)
    (models / "vae").mkdir(parents=True)
    (models / "vae" / "flux2-vae.safetensors").write_bytes(b"")
    args = ["train", "--profile", "klein-9b-1024", "--dataset", str(DATASET), "--out", str(tmp_path / "out")]
    assert main(args + ["--models", str(models)]) == 2
    err = capsys.readouterr().err
    assert "diffusion_models/flux-2-klein-base-9b.safetensors" in err and "text_encoders/qwen_3_8b_fp8mixed.safetensors" in err
    assert f"python -m ugpum download flux2-klein-base-9b --models {models}" in err and "vae/flux2-vae" not in err
    assert err.count("\n") == 1 and "Traceback" not in err                       # one sentence
    # an explicit file is named by its flag; the folder fills in the rest
    assert main(args + ["--models", str(models), "--text-encoder", str(tmp_path / "te.safetensors")]) == 2
    err = capsys.readouterr().err
    assert f"--text-encoder {tmp_path / 'te.safetensors'} (no such file)" in err
    assert "diffusion_models/flux-2-klein-base-9b.safetensors" in err and "qwen_3_8b" not in err
    assert main(args + ["--model", str(tmp_path / "dit.safetensors")]) == 2
    assert "dit.safetensors: no such file" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()                                        # nothing started


def test_guidance_trains_at_one_and_previews_at_the_templates_four():
    from ugpum.arch import get_spec
    from ugpum.train.objective import training_guidance
    from ugpum.render.prompt import guidance_for
    dev, klein = get_spec("flux2-dev"), get_spec("flux2-klein-9b")
    profile = load_config("flux2-dev-1024")
    assert (profile.guidance, profile.sample_guidance) == (1.0, 4.0)
    assert training_guidance(dev, None) == 1.0 and guidance_for(dev, None) == 4.0
    assert training_guidance(dev, 2.5) == 2.5 and training_guidance(klein, 2.5) is None
    assert load_config("klein-9b-1024").timesteps == "flux2_shift"


def test_a_model_streamed_from_its_file_is_dropped_after_training(tmp_path):
    """The engine places a DiT built on the meta device from its file, and drops those weights when
    the run ends (on the GPU they stayed allocated until a garbage collection: bench/results)."""
    from safetensors.torch import save_file

    from comfy_bridge import build_random
    from ugpum.arch import get_spec
    from ugpum.commands.train import build_encoders, build_model
    from ugpum.train.loop import train as engine
    path = tmp_path / "tiny.safetensors"
    save_file({k: v.contiguous() for k, v in build_random(get_spec("tiny-flux2"), torch.float32).state_dict().items()},
              str(path))
    c = cfg(steps=1, model_file=str(path))
    model, prefix = build_model(c)
    assert all(p.is_meta for p in model.parameters())
    engine(c, tmp_path / "run", model=model, encoders=build_encoders(c, None), key_prefix=prefix, **QUIET)
    assert all(p.is_meta for p in model.parameters()) and all(b.is_meta for b in model.buffers())


def test_compile_and_base_compute_settings_reach_the_engine(tmp_path, capsys):
    """compile=auto on the CPU says once why it runs eagerly; an 8-bit base on a device without it is
    one sentence (the kernels themselves: tests/test_compile.py, tests/test_base_compute.py)."""
    from ugpum.commands import main
    out = tmp_path / "run"
    assert main(["train", "--profile", "tiny-flux2", "--dataset", str(DATASET), "--devices", "cpu", "--steps", "1",
                 "--sample-every", "0", "--compile", "auto", "--out", str(out)]) == 0
    assert capsys.readouterr().out.count("compile=auto: blocks on cpu run eagerly") == 1
    workload = json.loads((out / "plan.json").read_text())["workload"]
    assert workload["held_dtype"] == workload["weight_dtype"] == "fp32"      # (weight_dtype: its older name)
    assert main(["train", "--profile", "tiny-flux2", "--dataset", str(DATASET), "--devices", "cpu", "--steps", "1",
                 "--sample-every", "0", "--base-compute", "fp8", "--out", str(tmp_path / "fp8")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fp8" in err and "Traceback" not in err
    assert load_config("tiny-flux2", overrides=dict(base_compute="int8")).workload().held_dtype == "fp8"
