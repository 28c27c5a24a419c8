"""Issue 16's judge: our training step against the peer's, in one process on one GPU.

  python bench/place_train.py write --model flux2-klein-9b --path /tmp/k9.safetensors
  python bench/speed.py --path /tmp/k9.safetensors --out bench/results            # klein 9B, 1024²
  python bench/speed.py --path /tmp/w14.safetensors --resolution 832x480 --frames 17 --out bench/results

Ours: ComfyUI's DiT streamed from a random-weight safetensors file onto the GPU (as bench/place_train.py),
LoRA r16 on every block Linear, per-block checkpointing, AdamW, bf16 autocast, batch 1, in each base
compute mode (bf16 / fp8 / int8, ugpum.compute.base_compute) eager and compiled (ugpum.compute.compile). The peer:
diffusers' Flux2Transformer2DModel / WanTransformer3DModel (random bf16 weights) + PEFT LoRA r16 on the
same block Linears, diffusers' gradient checkpointing, eager and with torch.compile on each block.
Appends one JSON object per measured case to OUT/speed.json (model, impl, mode, compiled, s_per_step,
first_step_s, peak_gib, forecast_s) and rewrites OUT/speed.md; `--grad-check` adds the per-block LoRA
gradient agreement of the 8-bit modes with bf16 at full size; `--profile` a torch.profiler summary.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from comfy_bridge import build_meta  # noqa: E402
from ugpum.arch import Workload, recognise  # noqa: E402
from ugpum.compute.base_compute import use_base_compute as use_8bit_base, supports  # noqa: E402
from ugpum.compute.recompute import recompute_blocks  # noqa: E402
from ugpum.commands.plan import resolution as _resolution  # noqa: E402
from ugpum.compute.compile import compile_blocks, compile_stats  # noqa: E402
from ugpum.planning.devices import detect_devices  # noqa: E402
from ugpum.compute.inplace_guard import guard_inplace_residuals  # noqa: E402
from ugpum.placement.place import Layout, place  # noqa: E402
from ugpum.planning.plan import make_plan  # noqa: E402
from ugpum.compute.lora import attach_lora, lora_targets  # noqa: E402

GIB = 1024 ** 3
DEV = "cuda"


def log(*a):
    print(*a, flush=True)


def timed_steps(step, steps: int):
    """(first-step seconds, median of the rest, allocator peak GiB) of `step()` called `steps` times."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    rest = times[1:] or times
    return times[0], statistics.median(rest), torch.cuda.max_memory_allocated() / GIB, times


def record(out: Path, row: dict) -> None:
    log(json.dumps(row))
    with open(out / "speed.json", "a") as f:
        f.write(json.dumps(row) + "\n")


# ------------------------------------------------------------------------------------------- ours

def ours(args, out: Path) -> None:
    spec, prefix, stored = recognise(args.path)
    width, height = args.resolution
    w = Workload(width=width, height=height, frames=args.frames, recompute="all", rank=16, held_dtype="bf16")
    plan = make_plan(spec, detect_devices(), w)
    model = build_meta(spec, torch.bfloat16)
    layout = Layout.from_plan(plan, [s.torch_device for s in plan.stages], spec.tail_modules)
    t0 = time.time()
    place(model, layout, checkpoint=args.path, key_prefix=prefix, dtype=torch.bfloat16)
    log(f"placed {spec.id} in {time.time() - t0:.1f} s; plan forecast {plan.predicted_step_s:.3f} s/step")
    block_paths = [b.path for b in spec.blocks]
    targets = lora_targets(block_paths, [b.linears for b in spec.blocks])
    lora = attach_lora(model, targets, rank=16, alpha=16)
    guards = guard_inplace_residuals(model, include_rms=False)
    params = [p for _, a in lora.items() for p in (a.A, a.B)]
    opt = torch.optim.AdamW(params, lr=1e-4)
    if spec.family == "wan":
        x = torch.randn(1, 16, 1 + (args.frames - 1) // 4, height // 8, width // 8, device=DEV)
        ctx = torch.randn(1, 512, spec.context_dim, device=DEV)
        t = torch.tensor([500.0], device=DEV)
    else:
        x = torch.randn(1, 128, height // 16, width // 16, device=DEV)
        ctx = torch.randn(1, 512, spec.context_dim, device=DEV)
        t = torch.tensor([0.5], device=DEV)

    def forward():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model(x, t, ctx, transformer_options={})

    def step():
        loss = (forward().float() - x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    if args.grad_check:
        try:
            grad_check(model, spec, lora, forward, out)
        except Exception as err:
            traceback.print_exc()
            record(out, {"model": spec.id, "impl": "grad_check", "error": f"{type(err).__name__}: {str(err)[:300]}"})
    for mode in args.modes:
        reason = supports(mode, DEV)
        if reason:
            record(out, {"model": spec.id, "impl": "ugpum", "mode": mode, "skipped": reason})
            continue
        for compiled in args.compiled:
            try:
                undo_base = use_8bit_base(model, targets, mode, log, keep="device")
                undo_compile = compile_blocks(model, block_paths, "on" if compiled else "off", log)
                undo_ckpt = recompute_blocks(model, block_paths)
                before = compile_stats()
                first, median, peak, times = timed_steps(step, args.steps + (1 if compiled else 0))
                after = compile_stats()
                row = {"model": spec.id, "impl": "ugpum", "mode": mode, "compiled": compiled,
                       "s_per_step": round(median, 4), "first_step_s": round(first, 2), "peak_gib": round(peak, 2),
                       "forecast_s": round(plan.predicted_step_s, 4), "step_times": [round(s, 4) for s in times],
                       "graphs_compiled": after.graphs - before.graphs, "graph_breaks": after.graph_breaks,
                       "shape": [width, height, args.frames]}
                if args.profile and compiled == args.compiled[-1]:
                    row["profile_file"] = profile(step, out / f"speed_profile_{spec.id}_{mode}_{int(compiled)}.txt")
                record(out, row)
            except Exception as err:                                   # record and go on to the next case
                traceback.print_exc()
                record(out, {"model": spec.id, "impl": "ugpum", "mode": mode, "compiled": compiled,
                             "error": f"{type(err).__name__}: {str(err)[:300]}"})
            finally:
                for undo in ("undo_ckpt", "undo_compile", "undo_base"):
                    fn = locals().get(undo)
                    if fn:
                        fn()
                opt.zero_grad(set_to_none=True)
            undo_ckpt = undo_compile = undo_base = None
    lora.remove()
    if args.plain:
        plain(args, out, spec, model, block_paths, x, t, ctx)
    for g in guards:
        g.remove()
    del model, opt, lora
    torch.cuda.empty_cache()


def plain(args, out: Path, spec, model, block_paths, x, t, ctx) -> None:
    """The same step with no LoRA (the input takes the gradient instead): what LoRA adds over plain."""
    xg = x.clone().requires_grad_(True)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            o = model(xg, t, ctx, transformer_options={})
        (o.float() - x).pow(2).mean().backward()
        xg.grad = None

    for compiled in args.compiled:
        undo_compile = compile_blocks(model, block_paths, "on" if compiled else "off", log)
        undo_ckpt = recompute_blocks(model, block_paths)
        try:
            first, median, peak, times = timed_steps(step, args.steps + (1 if compiled else 0))
            record(out, {"model": spec.id, "impl": "ugpum_plain", "mode": "bf16", "compiled": compiled,
                         "s_per_step": round(median, 4), "first_step_s": round(first, 2), "peak_gib": round(peak, 2),
                         "step_times": [round(s, 4) for s in times], "shape": list(args.resolution) + [args.frames]})
        except Exception as err:
            traceback.print_exc()
            record(out, {"model": spec.id, "impl": "ugpum_plain", "mode": "bf16", "compiled": compiled,
                         "error": f"{type(err).__name__}: {str(err)[:300]}"})
        finally:
            undo_ckpt()
            undo_compile()


def profile(step, path: Path) -> str:
    from torch.profiler import ProfilerActivity, profile as prof
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        step()
        torch.cuda.synchronize()
    path.write_text(p.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    return path.name


def grad_check(model, spec, lora, forward, out: Path) -> None:
    """Per block at full size: LoRA gradients through 8-bit base matmuls vs bf16 (cosine, rel. norm error).

    Each mode gets its own freshly captured block inputs (a no-grad forward of the whole model) and its
    own graph, so nothing one mode's backward frees can be reached by another's."""
    picks = [spec.blocks[0].path, spec.blocks[len(spec.blocks) // 2].path, spec.blocks[-1].path]
    g = torch.Generator(device=DEV).manual_seed(1)
    for path in picks:
        block = model.get_submodule(path)
        adapters = [(p, a) for p, a in lora.items() if p.startswith(path + ".")]
        with torch.no_grad():
            for _, a in adapters:
                a.B.normal_(0, 0.01, generator=g)
        ps = [p for _, a in adapters for p in (a.A, a.B)]
        res = {}
        for mode in ("bf16", "fp8", "int8"):
            if supports(mode, DEV):
                continue
            captured = {}
            hook = block.register_forward_pre_hook(
                lambda m, a, k: captured.setdefault("in", (a, k)), with_kwargs=True)
            with torch.no_grad():
                forward()
            hook.remove()
            args_, kwargs = captured["in"]
            args_ = [v.detach().clone() if torch.is_tensor(v) else v for v in args_]
            kwargs = {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in kwargs.items()}
            undo = use_8bit_base(model, [p for p, _ in adapters], mode, lambda *_: None, keep="device")
            try:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    o = block(*args_, **kwargs)
                outs = o if isinstance(o, (tuple, list)) else (o,)
                gen = torch.Generator(device=DEV).manual_seed(2)
                loss = sum((t.float() * torch.randn(t.shape, generator=gen, device=DEV)).sum() for t in outs)
                grads = torch.autograd.grad(loss, ps, allow_unused=True)
            finally:
                undo()
            res[mode] = torch.cat([(gr if gr is not None else torch.zeros_like(p)).flatten().float()
                                   for gr, p in zip(grads, ps)])
        for mode in ("fp8", "int8"):
            if mode in res:
                ref, got = res["bf16"], res[mode]
                cos = float(torch.nn.functional.cosine_similarity(ref, got, dim=0))
                rel = float((got - ref).norm() / ref.norm())
                record(out, {"model": spec.id, "impl": "grad_check", "block": path, "mode": mode,
                             "cosine_vs_bf16": round(cos, 5), "rel_norm_error": round(rel, 4)})
        with torch.no_grad():
            for _, a in adapters:
                a.B.zero_()


# ------------------------------------------------------------------------------------------- peer

def peer(args, out: Path, model_id: str) -> None:
    from peft import LoraConfig
    width, height = args.resolution
    if model_id.startswith("flux2"):
        from diffusers import Flux2Transformer2DModel
        with torch.device("meta"):
            net = Flux2Transformer2DModel(num_layers=8, num_single_layers=24, num_attention_heads=32,
                                          joint_attention_dim=12288, guidance_embeds=False)
        blocks = list(net.transformer_blocks) + list(net.single_transformer_blocks)
        n_img = (height // 16) * (width // 16)
        img_ids = torch.zeros(n_img, 4, device=DEV)
        img_ids[:, 1] = torch.arange(n_img, device=DEV) // (width // 16)
        img_ids[:, 2] = torch.arange(n_img, device=DEV) % (width // 16)
        txt_ids = torch.zeros(512, 4, device=DEV)
        txt_ids[:, 3] = torch.arange(512, device=DEV)
        hs = torch.randn(1, n_img, 128, device=DEV, dtype=torch.bfloat16)
        inputs = dict(hidden_states=hs, encoder_hidden_states=torch.randn(1, 512, 12288, device=DEV,
                      dtype=torch.bfloat16), timestep=torch.tensor([0.5], device=DEV), img_ids=img_ids,
                      txt_ids=txt_ids, return_dict=False)
    else:
        from diffusers import WanTransformer3DModel
        with torch.device("meta"):
            net = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128,
                                        in_channels=16, out_channels=16, text_dim=4096, freq_dim=256,
                                        ffn_dim=13824, num_layers=40, cross_attn_norm=True,
                                        qk_norm="rms_norm_across_heads", eps=1e-6)
        blocks = list(net.blocks)
        hs = torch.randn(1, 16, 1 + (args.frames - 1) // 4, height // 8, width // 8, device=DEV, dtype=torch.bfloat16)
        inputs = dict(hidden_states=hs, timestep=torch.tensor([500], device=DEV),
                      encoder_hidden_states=torch.randn(1, 512, 4096, device=DEV, dtype=torch.bfloat16),
                      return_dict=False)
    net = net.to_empty(device=DEV).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, p.shape[1] ** -0.5 if p.dim() == 2 else 0.02)
            else:
                p.fill_(1.0) if "norm" in name else p.normal_(0, 0.02)
        for b in net.buffers():
            b.zero_()
    net.requires_grad_(False)
    names = [n for n, m in net.named_modules() if isinstance(m, torch.nn.Linear)
             and ("transformer_blocks." in n or n.startswith("blocks."))]
    net.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=names, init_lora_weights=True))
    net.enable_gradient_checkpointing()
    net.train()
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    target = torch.randn_like(hs)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            o = net(**inputs)[0]
        (o.float() - target.float()).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for compiled in args.compiled:
        if compiled:
            for b in blocks:
                b.compile()
        try:
            first, median, peak, times = timed_steps(step, args.steps + (1 if compiled else 0))
            record(out, {"model": model_id, "impl": "peer_compiled" if compiled else "peer_eager", "mode": "bf16",
                         "compiled": compiled, "s_per_step": round(median, 4), "first_step_s": round(first, 2),
                         "peak_gib": round(peak, 2), "step_times": [round(s, 4) for s in times],
                         "lora_params": sum(p.numel() for p in params), "shape": [width, height, args.frames]})
        except Exception as err:
            traceback.print_exc()
            record(out, {"model": model_id, "impl": "peer_compiled" if compiled else "peer_eager", "mode": "bf16",
                         "compiled": compiled, "error": f"{type(err).__name__}: {str(err)[:300]}"})
    del net, opt
    torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------- report

NOTES = "## What the runs say"


def write_md(out: Path) -> None:
    rows = [json.loads(line) for line in (out / "speed.json").read_text().splitlines() if line.strip()]
    lines = ["# Speed (issue 16): our step vs the diffusers + PEFT peer, one H200", "",
             "Generated by bench/speed.py from speed.json (one row per measured case).", "",
             "| model | impl | mode | compiled | s/step | first step s | peak GiB | forecast s | call | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("impl") == "grad_check" or "s_per_step" not in r and "error" not in r and "skipped" not in r:
            continue
        note = r.get("error") or r.get("skipped") or (f"{r['graphs_compiled']} graphs, {r['graph_breaks']} breaks"
                                                       if "graphs_compiled" in r else "")
        lines.append(f"| {r['model']} | {r['impl']} | {r.get('mode', '')} | {r.get('compiled', '')} | "
                     f"{r.get('s_per_step', '')} | {r.get('first_step_s', '')} | {r.get('peak_gib', '')} | "
                     f"{r.get('forecast_s', '')} | {r.get('call', '')} | {note} |")
    checks = [r for r in rows if r.get("impl") == "grad_check" and "cosine_vs_bf16" in r]
    if checks:
        lines += ["", "## LoRA gradients, 8-bit base vs bf16 base, per block at full size", "",
                  "| model | block | mode | cosine | rel. norm error |", "|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['block']} | {r['mode']} | {r['cosine_vs_bf16']} | {r['rel_norm_error']} |"
                  for r in checks]
    notes = ""                              # the hand-written reading of the runs is kept
    if (out / "speed.md").is_file():
        old = (out / "speed.md").read_text()
        notes = old[old.index(NOTES):] if NOTES in old else ""
    (out / "speed.md").write_text("\n".join(lines) + "\n" + ("\n" + notes if notes else ""))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", required=True, help="random-weight checkpoint (bench/place_train.py write)")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--resolution", type=_resolution, default=(1024, 1024))
    p.add_argument("--frames", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--modes", nargs="+", default=["bf16", "fp8", "int8"])
    p.add_argument("--compiled", nargs="+", type=lambda s: s in ("1", "true", "on"), default=[False, True])
    p.add_argument("--impl", nargs="+", default=["ugpum", "peer"])
    p.add_argument("--grad-check", action="store_true")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--plain", action="store_true", help="also time the step without LoRA (LoRA's share)")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model_id = recognise(a.path)[0].id
    if "ugpum" in a.impl:
        ours(a, out)
    if "peer" in a.impl:
        try:
            peer(a, out, model_id)
        except Exception as err:
            traceback.print_exc()
            record(out, {"model": model_id, "impl": "peer", "error": f"{type(err).__name__}: {str(err)[:300]}"})
    write_md(out)


if __name__ == "__main__":
    main()
