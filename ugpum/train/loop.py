"""The training loop: dataset -> cached features -> plan -> placed model with LoRA -> steps.

Read it top to bottom: `train()` is the whole story; the helpers above it each do one thing.
"""
from __future__ import annotations

import dataclasses
import json
import math
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..arch import get_spec
from ..formats.atomic import atomic_path, write_json_atomic
from ..base_compute import QuantiseAsLoaded, check_devices, use_8bit_base
from ..checkpointing import checkpoint_blocks
from ..compile import compile_blocks, compile_stats
from ..devices import resolve_devices
from ..distributed.schedules import DISTRIBUTED_ONLY
from ..dtypes import TORCH_DTYPES
from ..inplace_guard import guard_inplace_residuals
from ..formats.lora_file import lora_metadata, save_lora
from ..pipeline import accumulate
from ..place import place_by_plan
from ..report import grid, save_animation, to_pil
from ..plan import Plan, plan_training
from .cache import FeatureCache, dataset_hash
from .checkpoint import (check_same_run, disk_full, header_digest, latest_checkpoint, load_checkpoint,
                         remove_leftovers, save_checkpoint)
from .config import TrainConfig
from .dataset import ImageItem, caption_dropout
from .musubi_toml import check_inside, load_musubi_toml
from .encoders import Encoders
from .flow import flow_loss, noisy, sample_timesteps, timestep_method
from .lora import LoraSet, attach_lora, lora_targets
from .progress import Progress
from .stopping import saving, stop_on_sigterm
from .flow_sampler import pad_flux2_context
from .render_prompt import render
from .video import ClipItem, load_folder

class TrainingError(RuntimeError):
    pass


class RunExists(TrainingError):
    """The output folder holds an earlier run; the message says how to continue or replace it."""


@dataclass
class TrainResult:
    lora_path: Path
    steps_done: int
    losses: list[float]
    plan: Plan
    cache_hits: int
    cache_misses: int
    validation_before: float
    validation_after: float
    peak_gib: dict[str, float] = field(default_factory=dict)
    samples: list[Path] = field(default_factory=list)
    sample_grid: Path | None = None
    resumed_at: int = 0                   # the checkpoint's step a resumed run started from


def load_items(cfg: TrainConfig) -> list[ImageItem]:
    path = Path(cfg.dataset)
    family = get_spec(cfg.model).family
    if cfg.dataset_root:                 # the nodes: checked again as it is read (a TOML may have changed)
        check_inside(path, cfg.dataset_root)
    if path.suffix == ".toml":
        return load_musubi_toml(path, cfg.trigger, family, cfg.frames, cfg.frame_stride, cfg.resolution)
    return load_folder(path, family, frames=cfg.frames, stride=cfg.frame_stride,
                       resolution=cfg.resolution, repeats=cfg.repeats, trigger=cfg.trigger)


class MicroBatches:
    """Which dataset items the k-th micro-batch takes. Every epoch is a fresh seeded shuffle; items
    of one shape (latent and text tokens: one tensor stacks them) are grouped `batch` at a time in
    the order they come, and a group left short at the epoch's end is a smaller micro-batch. With
    batch 1 it is the shuffle itself."""

    def __init__(self, shapes: list[tuple], batch: int, seed: int):
        self.shapes, self.batch, self.seed = shapes, batch, seed
        self._epoch, self._groups = -1, []
        self.per_epoch = len(self._for_epoch(0))

    def _for_epoch(self, epoch: int) -> list[list[int]]:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**63)
            filling: dict[tuple, list[int]] = {}
            groups = []
            for i in torch.randperm(len(self.shapes), generator=g).tolist():
                group = filling.setdefault(self.shapes[i], [])
                group.append(i)
                if len(group) == self.batch:
                    groups.append(filling.pop(self.shapes[i]))
            self._epoch, self._groups = epoch, groups + list(filling.values())
        return self._groups

    def __call__(self, k: int) -> list[int]:
        epoch, j = divmod(k, self.per_epoch)
        return self._for_epoch(epoch)[j]


def lr_factor(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "cosine":
        progress = (step - cfg.warmup_steps) / max(cfg.steps - cfg.warmup_steps, 1)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return 1.0


def make_optimizer(cfg: TrainConfig, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise TrainingError("optimizer 'adamw8bit' needs bitsandbytes (pip install bitsandbytes)") from None
        return bnb.optim.AdamW8bit(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def model_context(spec, context: torch.Tensor) -> torch.Tensor:
    """[1, L, C] text context as ComfyUI feeds it: FLUX.2 pads it to 512 tokens (zeros in front)."""
    return pad_flux2_context(context[None]) if spec.family == "flux2" else context[None]


TRAINING_GUIDANCE = 1.0     # guidance-distilled models train at 1.0, as musubi-tuner trains them


def training_guidance(spec, setting: float | None) -> float | None:
    """The guidance-embedding input in training (models that have one): the setting, else 1.0."""
    if not spec.guidance:
        return None
    return TRAINING_GUIDANCE if setting is None else float(setting)


def image_tokens(spec, latent_shape) -> int:
    """Image tokens of one latent: FLUX.2 [C, h, w] at one token per latent pixel (2x2 patchified
    already); Wan [C, T, h, w] in 2x2 patches per latent frame."""
    if spec.family == "wan":
        return latent_shape[-3] * (latent_shape[-2] // 2) * (latent_shape[-1] // 2)
    return latent_shape[-2] * latent_shape[-1]


def loss_at(model, spec, cfg: TrainConfig, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor,
            context: torch.Tensor, first: str, weighting: str) -> torch.Tensor:
    """The model's flow-matching loss for samples x0 [B, ...] noised to timesteps t [B]; `context`:
    the model's text input [B, L, C] (`model_context`)."""
    device = torch.device(first)
    extra = {}
    guidance = training_guidance(spec, cfg.guidance)      # FLUX.2 dev: without it ComfyUI skips the embedder
    if guidance is not None:
        extra["guidance"] = torch.full((x0.shape[0],), guidance, device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.autocast and device.type == "cuda"):
        pred = model(noisy(x0, noise, t).to(device), (t * spec.timestep_scale).to(device),
                     context.to(device), transformer_options={}, **extra)
    out = pred.device
    return flow_loss(pred.float(), x0.to(out), noise.to(out), t.to(out), weighting)


def micro_loss(model, spec, cfg: TrainConfig, latents: list[torch.Tensor], contexts: list[torch.Tensor], k: int,
               first: str) -> torch.Tensor:
    """Forward of the k-th micro-batch (latents of one shape, contexts of one length): its
    flow-matching loss, the mean over its samples (the caller runs backward)."""
    g = torch.Generator().manual_seed((cfg.seed * 7_919 + k) % 2**63)   # the same draws on any device
    x0 = torch.stack([latent.float() for latent in latents])
    noise = torch.randn(x0.shape, generator=g)
    t = sample_timesteps(len(latents), timestep_method(cfg.timesteps, spec.family), g, shift=cfg.shift,
                         image_seq_len=image_tokens(spec, latents[0].shape))   # per bucket: its own tokens
    context = torch.cat([model_context(spec, c) for c in contexts])
    return loss_at(model, spec, cfg, x0, noise, t, context, first, cfg.weighting)


VALIDATION_T = (0.25, 0.5, 0.75)


def validation_picks(items: list[ImageItem], limit: int = 16) -> list[int]:
    """Up to `limit` distinct samples, spread evenly over the dataset: a repeated item counts once, a
    clip taken at two lengths (musubi target_frames) twice."""
    seen, distinct = set(), []
    for n, item in enumerate(items):
        key = (item.path, getattr(item, "frames", 1))
        if key not in seen:
            seen.add(key)
            distinct.append(n)
    if len(distinct) <= limit:
        return distinct
    return [distinct[round(j * (len(distinct) - 1) / (limit - 1))] for j in range(limit)]


def validation_inputs(spec, latents, contexts, picks: list[int]):
    """(x0, noise, t, context) of each validation forward, in order: every picked item (batch 1) on
    its own fixed noise, at each of VALIDATION_T (the distributed run takes the same ones)."""
    for seed, i in enumerate(picks):
        g = torch.Generator().manual_seed(10_007 + seed)
        x0 = latents[i][None].float()
        noise = torch.randn(x0.shape, generator=g)
        context = model_context(spec, contexts[i])
        for t in VALIDATION_T:
            yield x0, noise, torch.tensor([t]), context


@torch.no_grad()
def validation_loss(model, spec, cfg: TrainConfig, latents, contexts, first: str, picks: list[int]) -> float:
    """Loss on fixed noise at fixed timesteps over the picked items: a smooth measure of progress,
    unlike the training loss, whose random timesteps make it jump from step to step."""
    total, n = 0.0, 0
    for x0, noise, t, context in validation_inputs(spec, latents, contexts, picks):
        total += loss_at(model, spec, cfg, x0, noise, t, context, first, "none").item()
        n += 1
    return total / n


def plan_for(cfg: TrainConfig) -> Plan:
    """The plan a run with these settings uses (what the Partition Planner node and `plan` show)."""
    if cfg.schedule in DISTRIBUTED_ONLY:
        raise TrainingError(f"schedule {cfg.schedule} runs two pipeline stages on each rank of a distributed run "
                            "(torchrun ... --distributed, README \"Past one machine\"); one process runs auto, "
                            "sequential, gpipe or 1f1b")
    spec = get_spec(cfg.model)
    return plan_training(spec, resolve_devices(cfg.devices, spec, training=True), cfg.workload(),
                         grad_accum=cfg.grad_accum, schedule=cfg.schedule)


def open_run(cfg: TrainConfig, spec, out: Path, resume: bool, overwrite: bool, log=print):
    """The run folder made ready and the run's data read, before any work: leftovers of an interrupted
    save removed; for `resume` the checkpoint to continue (only the same run), else the folder checked
    free of an earlier run (replaced only with `overwrite`). Returns (items, dataset hash, run identity,
    checkpoint or None, first step)."""
    out.mkdir(parents=True, exist_ok=True)
    removed = remove_leftovers(out)
    if removed:
        log(f"removed {len(removed)} temporary file(s) an interrupted save left in {out}")
    items = load_items(cfg)
    data_hash = dataset_hash(items)
    identity = run_identity(cfg, spec, data_hash)
    if resume:
        checkpoint, start = resume_point(out, cfg, identity, log)
    else:
        checkpoint, start = None, 0
        held = earlier_run(out, cfg)
        if held and not overwrite:
            raise RunExists(f"{out} holds an earlier run ({held}); continue it with --resume {out}, train into "
                            "another folder, or pass --overwrite to replace it")
        clear_earlier_run(out, cfg)                      # (what a run that never stepped left, or --overwrite)
        if held:
            log(f"replacing the earlier run in {out} (overwrite)")
    return items, data_hash, identity, checkpoint, start


def prepare_model(cfg: TrainConfig, spec, plan: Plan, model, key_prefix: str = "", log=print):
    """Place the DiT by the plan (streaming it from its file when built on meta), attach the LoRA,
    make it safe to differentiate, run its frozen base in `base_compute`, compile its blocks
    (`compile`) and checkpoint them (compiled first: checkpointing wraps the compiled forward)."""
    dtype = TORCH_DTYPES[cfg.weight_dtype]
    if cfg.base_compute != "bf16" and plan.offloaded_blocks:
        raise TrainingError(f"base_compute = {cfg.base_compute} does not work with block swap yet (this plan swaps "
                            f"{len(plan.offloaded_blocks)} blocks); use base_compute = bf16, or more GPU memory")
    on_meta = any(p.is_meta for p in model.parameters())     # streamed from its file: dropped after
    block_paths = [b.path for b in spec.blocks]
    linears = [b.linears for b in spec.blocks]
    base_linears = lora_targets(block_paths, linears)
    quantise = None
    if on_meta and cfg.base_compute != "bf16":     # 8-bit as each weight arrives: the bf16 base never lands whole
        check_devices(cfg.base_compute, [s.torch_device for s in plan.stages])
        quantise = QuantiseAsLoaded(base_linears, cfg.base_compute)
        model.requires_grad_(False)               # the base is frozen anyway (attach_lora); 8-bit needs it now
    placement = place_by_plan(model, plan, spec.tail_modules, cfg.model_file, key_prefix, dtype, on_weight=quantise)
    lora = attach_lora(model, lora_targets(block_paths, linears, tuple(cfg.targets)), cfg.rank, cfg.alpha,
                       seed=cfg.seed)
    if quantise is not None:
        log(quantise.summary())
        undo_8bit = lambda: None                 # noqa: E731 - nothing to put back: the model is dropped after
    else:
        undo_8bit = use_8bit_base(model, base_linears, cfg.base_compute, log, keep="cpu")
    guards = guard_inplace_residuals(model, include_rms=False)
    undo_compile = compile_blocks(model, block_paths, cfg.compile, log)
    undo_ckpt = checkpoint_blocks(model, block_paths) if cfg.checkpointing else (lambda: None)

    def release():
        undo_ckpt()
        undo_compile()
        for g in guards:
            g.remove()
        lora.remove()
        if not on_meta:                  # (a model streamed from its file is dropped below instead)
            undo_8bit()
        placement.undo("meta" if on_meta else None)
    return model, lora, placement.layout, release


def save_final_lora(cfg: TrainConfig, spec, lora: LoraSet, out: Path, steps: int, data_hash: str, name: str) -> Path:
    meta = lora_metadata(architecture=f"{spec.title}/lora", base_model=spec.id, title=cfg.output_name,
                         target_modules=sorted({p.rsplit(".", 1)[0] + "." + p.rsplit(".", 1)[1] for p, _ in lora.items()}),
                         steps=steps, resolution=cfg.resolution, dataset_hash=data_hash, implementation="ugpum")
    tensors = {path: (a.A.detach().cpu(), a.B.detach().cpu()) for path, a in lora.items()}
    try:
        return save_lora(out / name, tensors, cfg.rank, cfg.alpha, meta, dtype=torch.float32)
    except Exception as err:
        full = disk_full(err, f"the LoRA {name}", out, sum(a.A.numel() + a.B.numel() for _, a in lora.items()) * 4)
        if full is err:
            raise
        raise full from err


def lora_shapes(cfg: TrainConfig, spec) -> dict[str, list[int]]:
    """Every adapter's [rank, in, out], from the model's description alone (before anything is built)."""
    shapes = {}
    for block in spec.blocks:
        for lin in block.linears:
            path = f"{block.path}.{lin.path}"
            if path in lora_targets([block.path], [(lin,)], tuple(cfg.targets)):
                shapes[path] = [cfg.rank, lin.in_features, lin.out_features]
    return shapes


def run_identity(cfg: TrainConfig, spec, data_hash: str) -> dict:
    """What makes a run this run, recorded in every checkpoint and compared on resume: the whole
    config, the dataset's content hash, the model (and its file's header digest), the LoRA's shapes."""
    return {"config": dataclasses.asdict(cfg), "dataset_hash": data_hash, "lora_shapes": lora_shapes(cfg, spec),
            "model": {"id": spec.id, "family": spec.family,
                      "header_digest": header_digest(cfg.model_file) if cfg.model_file else None}}


RUN_FILES = ("metrics.jsonl", "checkpoints", "plan.json", "samples")


def earlier_run(out: Path, cfg: TrainConfig) -> str | None:
    """What an earlier run trained into `out` (steps logged, a checkpoint, a LoRA), or None when it
    holds nothing trained (a fresh folder, or a run that stopped before its first step)."""
    metrics = out / "metrics.jsonl"
    found = [f"metrics of {len(metrics.read_text().splitlines())} step(s)"] \
        if metrics.is_file() and metrics.stat().st_size else []
    checkpoint = latest_checkpoint(out)
    found += [f"checkpoint {checkpoint.name}"] if checkpoint else []
    found += sorted(p.name for p in out.glob(f"{cfg.output_name}*.safetensors"))
    return ", ".join(found) or None


def clear_earlier_run(out: Path, cfg: TrainConfig) -> None:
    """--overwrite: remove an earlier run's files (the feature cache stays: it is keyed by content)."""
    for name in RUN_FILES:
        path = out / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    for path in out.glob(f"{cfg.output_name}*.safetensors"):
        path.unlink()


def resume_point(out: Path, cfg: TrainConfig, identity: dict, log) -> tuple[Path, int]:
    """The checkpoint a resume continues from and its step, after checking it is this run's, lies
    within the run's steps and agrees with the metrics; a sentence otherwise."""
    folder = latest_checkpoint(out)
    if folder is None:
        raise TrainingError(f"--resume {out}: no complete checkpoint in {out / 'checkpoints'}")
    state = json.loads((folder / "state.json").read_text())
    check_same_run(state.get("identity") or {}, identity, folder)
    step = state["step"]
    if not 0 < step <= cfg.steps:
        more = f"; set steps above {step} to train on" if step > cfg.steps else ""
        raise TrainingError(f"--resume {out}: its checkpoint is at step {step}, outside this run's 1..{cfg.steps}{more}")
    metrics = out / "metrics.jsonl"
    try:
        logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    except (ValueError, KeyError, TypeError):
        logged = None
    if logged is None or logged[:step] != list(range(1, step + 1)):
        raise TrainingError(f"--resume {out}: metrics.jsonl does not record steps 1..{step} of its checkpoint "
                            "(edited or from another run); it cannot be trusted: start a new run in another folder")
    log(f"resumed from {folder} at step {step}")
    return folder, step


def train(cfg: TrainConfig, out: str | Path, model: torch.nn.Module, encoders: Encoders, key_prefix: str = "",
          resume: bool = False, overwrite: bool = False, on_step: Callable[[int, int, float], None] | None = None,
          check_interrupt: Callable[[], None] | None = None, log=print,
          on_sample: Callable[[int, object], None] | None = None, plan: Plan | None = None,
          on_partial_lora: Callable[[Path], None] | None = None) -> TrainResult:
    """Train `cfg`'s LoRA on `model` (ComfyUI's DiT module, on the meta device to be streamed from
    `cfg.model_file`, or with weights) with `encoders`, into `out`. `plan`: the one the Partition
    Planner showed; None plans here, with the same function. `resume` continues the run in `out` (only
    the same run); a new run never replaces an earlier one unless `overwrite`. Every way the run ends
    keeps every completed step: a checkpoint, and the LoRA so far (`on_partial_lora` hears of it)."""
    out = Path(out)
    spec = get_spec(cfg.model)
    # 1. the data, and whether this run may start or continue here (before any work)
    items, data_hash, identity, checkpoint, start = open_run(cfg, spec, out, resume, overwrite, log)

    # 2. every latent and caption embedding through the cache (encoders released after)
    cache = FeatureCache(cfg.cache_dir or out / "cache", encoders)
    try:
        latents = [cache.latent(item) for item in items]
        rng = random.Random(cfg.seed)
        captions = [caption_dropout(item.caption, cfg.caption_dropout, rng) for item in items]
        contexts = [cache.text(c) for c in captions]
        if cfg.sample_every:
            prompt = cache.text(cfg.sample_prompt or items[0].caption)
            negative = cache.text("")
    finally:                                         # text encoder and VAE leave the GPUs before the DiT
        release_encoders = getattr(encoders, "release", None)     # (and a split encoder on failure)
        if release_encoders:
            release_encoders()
    log(f"features: {len(items)} items, cache {cache.hits} hit(s), {cache.misses} computed")

    # 3. plan, then the placed model with its LoRA
    plan = plan or plan_for(cfg)
    write_json_atomic(out / "plan.json", plan.to_json())
    cuda_devices = sorted({s.torch_device for s in plan.stages if s.torch_device.startswith("cuda")})
    log(plan.verdict)
    if cfg.guidance is not None and not spec.guidance:
        log(f"note: setting 'guidance' = {cfg.guidance} is ignored: {spec.id} has no guidance embedding")
    model, lora, layout, release = prepare_model(cfg, spec, plan, model, key_prefix, log)
    try:
        return _steps(cfg, spec, out, model, lora, layout, plan, items, latents, contexts, data_hash, identity,
                      checkpoint, start, cuda_devices, encoders, prompt if cfg.sample_every else None,
                      negative if cfg.sample_every else None, cache, on_step, check_interrupt, log, on_sample,
                      on_partial_lora)
    finally:
        release()


def _steps(cfg, spec, out, model, lora, layout, plan, items, latents, contexts, data_hash, identity, checkpoint,
           start, cuda_devices, encoders, prompt, negative, cache, on_step, check_interrupt, log, on_sample,
           on_partial_lora) -> TrainResult:
    """The optimizer steps, the final save, validation and samples (train()'s second half)."""
    if cfg.grad_accum > 1:
        log(f"micro-batch schedule: {plan.schedule}")
    params = [p for _, a in lora.items() for p in (a.A, a.B)]
    optimizer = make_optimizer(cfg, params)
    metrics_path = out / "metrics.jsonl"
    if checkpoint is not None:
        load_checkpoint(checkpoint, lora, optimizer)
        kept = metrics_path.read_text().splitlines()[:start]             # steps after the checkpoint retrain
        metrics_path.write_text("".join(line + "\n" for line in kept))

    first = layout.first                                  # where the model's inputs go
    losses: list[float] = []
    step = saved = start                                  # `saved`: the step the newest save holds
    picks = validation_picks(items)
    micro_batches = MicroBatches([(tuple(latent.shape), model_context(spec, context).shape[1])
                                  for latent, context in zip(latents, contexts)], cfg.batch, cfg.seed)
    samples: list[Path] = []
    # clips preview at the first clip's bucket (e.g. 832x480): the first frame as PNG (the before/after
    # grid, the node's preview) and the whole sampled clip as an animated WebP beside it
    sample_w, sample_h = next((i.bucket for i in items if isinstance(i, ClipItem)), (cfg.resolution,) * 2)

    def take_sample(at: int) -> None:
        frames = [to_pil(f) for f in render(model, spec, encoders.decode, prompt, negative, sample_w, sample_h,
                                            cfg.sample_seed, cfg.sample_steps, cfg.frames, cfg.sample_guidance)]
        image = frames[0]
        path = out / "samples" / f"step_{at:05d}.png"
        path.parent.mkdir(exist_ok=True)
        if len(frames) > 1:
            with atomic_path(path.with_suffix(".webp")) as tmp:
                save_animation(frames, tmp)
        with atomic_path(path) as tmp:
            image.save(tmp, format="PNG")
        samples.append(path)
        if on_sample:
            on_sample(at, image)

    def save(at: int, name: str, stopping: bool = False) -> Path:
        """A checkpoint and the LoRA at step `at`, neither cut short by a signal."""
        nonlocal saved
        log(f"saving checkpoint and LoRA at step {at}")
        with saving(log, stopping):
            save_checkpoint(out, at, lora, optimizer, {"model": spec.id, "identity": identity,
                                                       "interrupted": stopping})
            path = save_final_lora(cfg, spec, lora, out, at, data_hash, name)
            saved = at
        return path

    last_save_time = time.monotonic()
    try:
        with stop_on_sigterm():
            validation_before = validation_loss(model, spec, cfg, latents, contexts, first, picks)
            log(f"validation loss before: {validation_before:.4f}")
            if cfg.sample_every and start == 0:
                take_sample(0)                                   # "before": the LoRA starts as a no-op
            progress = Progress(cfg.steps, start)
            for dev in cuda_devices:
                torch.cuda.reset_peak_memory_stats(dev)
            while step < cfg.steps:
                t0 = time.perf_counter()
                for group in optimizer.param_groups:
                    group["lr"] = cfg.lr * lr_factor(cfg, step)
                if check_interrupt:
                    check_interrupt()

                def one(k: int) -> torch.Tensor:
                    picked = micro_batches(k)
                    return micro_loss(model, spec, cfg, [latents[i] for i in picked], [contexts[i] for i in picked],
                                      k, first) / cfg.grad_accum
                ks = [step * cfg.grad_accum + j for j in range(cfg.grad_accum)]
                loss = sum(float(x) for x in accumulate(one, ks, plan.schedule, layout, model))
                if cfg.max_grad_norm:
                    torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                losses.append(loss)
                with open(metrics_path, "a") as f:
                    f.write(json.dumps({"step": step, "loss": loss, "lr": optimizer.param_groups[0]["lr"],
                                        "seconds": round(time.perf_counter() - t0, 4)}) + "\n")
                progress.update(step, loss)
                if step == start + 1 and compile_stats().graphs:      # what the first step compiled
                    log(compile_stats().line())
                if on_step:
                    on_step(step, cfg.steps, loss)
                due = (cfg.save_every and step % cfg.save_every == 0) or \
                    (cfg.save_every_minutes and time.monotonic() - last_save_time >= 60 * cfg.save_every_minutes)
                if due and step < cfg.steps:
                    save(step, f"{cfg.output_name}_step{step}.safetensors")
                    last_save_time = time.monotonic()
                if cfg.sample_every and step % cfg.sample_every == 0 and step < cfg.steps:
                    take_sample(step)
            # the trained LoRA first: what follows (validation, the "after" sample) can only be lost
            lora_path = save(step, f"{cfg.output_name}.safetensors")
            peak = {d: round(torch.cuda.max_memory_allocated(d) / 2**30, 3) for d in cuda_devices}
            validation_after = validation_loss(model, spec, cfg, latents, contexts, first, picks)
            log(f"validation loss after {step} steps: {validation_after:.4f}" +
                "".join(f"; peak {d}: {g:.2f} GiB" for d, g in peak.items()))
            grid_path = None
            if cfg.sample_every:
                take_sample(step)                                # "after"
                grid_path = out / "samples" / "before_after.png"
                from PIL import Image
                with Image.open(samples[0]) as before, Image.open(samples[-1]) as after, \
                        atomic_path(grid_path) as tmp:
                    grid([("before", [before.copy()]), (f"after {step}", [after.copy()])]).save(tmp, format="PNG")
    except BaseException:
        # Ctrl-C, SIGTERM, ComfyUI's Cancel or an error: keep what the completed steps trained, then stop
        if step > saved:
            done = step == cfg.steps
            partial = save(step, f"{cfg.output_name}{'' if done else f'_step{step}'}.safetensors", stopping=True)
            log(f"\nstopped at step {step}: checkpoint and LoRA saved in {out}; continue with --resume {out}")
            if on_partial_lora:
                on_partial_lora(partial)
        raise
    return TrainResult(lora_path, step, losses, plan, cache.hits, cache.misses, validation_before,
                       validation_after, peak, samples, grid_path, resumed_at=start)
