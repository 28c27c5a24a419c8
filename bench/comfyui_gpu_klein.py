"""FLUX.2 [klein] 9B at full size through the nodes in a ComfyUI running in its default GPU mode, with
ComfyUI's memory watched around our run (issue 17 item 1; bench/session.sh nodes runs it).

The model files (bench/model_files.py klein-folder: random weights, real formats, ComfyUI's names) are linked into
the test server's models folder (tests/support/comfy_server.py, started without --cpu). Phases, each one
prompt, with GPU memory sampled every 0.25 s from NVML (the whole GPU) and ComfyUI's /system_stats
(comfy.model_management's own view: free VRAM, and torch's reserved / reserved-but-free memory):

  idle           the server just started
  stock_before   ComfyUI alone: UNETLoader + CLIPLoader(flux2) + VAELoader -> the workflow's inference
                 branch (CFGGuider, Flux2Scheduler, SamplerCustomAdvanced, VAEDecode, SaveImage)
  freed_before   POST /free (unload models, free memory): the baseline
  ugpum          UGPUM Loader -> Partition Planner -> LoRA Trainer (real CLIP and VAE) -> Sample Preview
  freed_after    POST /free again: our memory must be back at the baseline
  stock_after    the stock branch again, with our LoRA through the stock LoraLoaderModelOnly: ComfyUI must
                 load and sample as before
  workflow       the example workflow's shape in one prompt: Trainer -> LORA_MODEL -> stock Load LoRA Model
                 (LoraModelLoader) -> the stock sampler
  freed_end      POST /free

Writes OUT/klein9b_gpu.json (every sample and a per-phase summary) and prints a table.

    COMFYUI_PATH=.carry/comfyui UGPUM_TEST_COMFYUI_GPU=1 python3 bench/comfyui_gpu_klein.py \
        --models /tmp/k9models --out OUT [--steps 4] [--resolution 512]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from support.comfy_server import ComfyServer, execution_error  # noqa: E402

GIB = 1024 ** 3
DIT = "flux-2-klein-9b.safetensors"
TE = "qwen_3_8b_fp8mixed.safetensors"
VAE = "flux2-vae.safetensors"
PROMPT = "loranne, a cartoon woman with a teal bob haircut, waving, in a park"


class Monitor(threading.Thread):
    """GPU memory every `period` s: NVML used (whole device) and ComfyUI's /system_stats."""

    def __init__(self, server: ComfyServer, period: float = 0.25):
        super().__init__(daemon=True)
        self.server, self.period, self.phase = server, period, "start"
        self.samples: list[dict] = []
        self.stop_event = threading.Event()
        try:
            import pynvml
            pynvml.nvmlInit()
            self._nvml = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception as e:          # noqa: BLE001  (no NVML: CPU trial runs)
            print(f"NVML unavailable: {e}")
            self._nvml = None

    def sample(self) -> dict:
        s = {"t": time.time(), "phase": self.phase}
        if self._nvml:
            pynvml, h = self._nvml
            s["nvml_used_gib"] = pynvml.nvmlDeviceGetMemoryInfo(h).used / GIB
        try:
            dev = self.server.get_json("/system_stats", timeout=5)["devices"][0]
            s["comfy_vram_free_gib"] = dev["vram_free"] / GIB
            s["torch_reserved_gib"] = dev["torch_vram_total"] / GIB
            s["torch_allocated_gib"] = (dev["torch_vram_total"] - dev["torch_vram_free"]) / GIB
        except Exception as e:          # noqa: BLE001
            s["stats_error"] = repr(e)[:200]
        return s

    def run(self) -> None:
        while not self.stop_event.is_set():
            self.samples.append(self.sample())
            time.sleep(self.period)

    def mark(self, phase: str) -> dict:
        """A sample at a phase boundary (end of the previous phase), then switch."""
        s = self.sample()
        s["boundary"] = f"end of {self.phase}"
        self.samples.append(s)
        self.phase = phase
        return s


def stock_branch(lora: dict | None, prefix: str, res: int, first: int = 100) -> dict:
    """The klein workflow's inference branch: ComfyUI's own loaders and sampler nodes."""
    n = lambda i: str(first + i)            # noqa: E731
    p = {
        n(0): {"class_type": "UNETLoader", "inputs": {"unet_name": DIT, "weight_dtype": "default"}},
        n(1): {"class_type": "CLIPLoader", "inputs": {"clip_name": TE, "type": "flux2"}},
        n(2): {"class_type": "VAELoader", "inputs": {"vae_name": VAE}},
        n(3): {"class_type": "CLIPTextEncode", "inputs": {"clip": [n(1), 0], "text": PROMPT + ", reading a book"}},
        n(4): {"class_type": "CLIPTextEncode", "inputs": {"clip": [n(1), 0], "text": ""}},
        n(6): {"class_type": "CFGGuider", "inputs": {"model": [n(5), 0], "positive": [n(3), 0],
                                                     "negative": [n(4), 0], "cfg": 1.0}},
        n(7): {"class_type": "RandomNoise", "inputs": {"noise_seed": 1234}},
        n(8): {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}},
        n(9): {"class_type": "Flux2Scheduler", "inputs": {"steps": 4, "width": res, "height": res}},
        n(10): {"class_type": "EmptyFlux2LatentImage", "inputs": {"width": res, "height": res, "batch_size": 1}},
        n(11): {"class_type": "SamplerCustomAdvanced", "inputs": {
            "noise": [n(7), 0], "guider": [n(6), 0], "sampler": [n(8), 0], "sigmas": [n(9), 0],
            "latent_image": [n(10), 0]}},
        n(12): {"class_type": "VAEDecode", "inputs": {"samples": [n(11), 0], "vae": [n(2), 0]}},
        n(13): {"class_type": "SaveImage", "inputs": {"images": [n(12), 0], "filename_prefix": prefix}},
    }
    if lora is None:
        p[n(6)]["inputs"]["model"] = [n(0), 0]
    else:
        p[n(5)] = lora
        p[n(5)]["inputs"]["model"] = [n(0), 0]
    return p


def ugpum_chain(save_name: str, steps: int, res: int) -> dict:
    return {
        "1": {"class_type": "UGPUMLoader", "inputs": {"dit_name": DIT, "weight_dtype": "as stored", "devices": "auto"}},
        "2": {"class_type": "UGPUMPartitionPlanner", "inputs": {
            "model": ["1", 0], "resolution": res, "batch": 1, "grad_accum": 1, "rank": 16, "checkpointing": "block"}},
        "3": {"class_type": "CLIPLoader", "inputs": {"clip_name": TE, "type": "flux2"}},
        "4": {"class_type": "VAELoader", "inputs": {"vae_name": VAE}},
        "5": {"class_type": "UGPUMLoRATrainer", "inputs": {
            "model": ["1", 0], "plan": ["2", 0], "dataset": "demo/loranne", "trigger_word": "loranne",
            "steps": steps, "learning_rate": 1e-4, "alpha": 16.0, "seed": 42, "sample_prompt": PROMPT,
            "sample_every": 0, "save_name": save_name, "clip": ["3", 0], "vae": ["4", 0]}},
        "8": {"class_type": "UGPUMSamplePreview", "inputs": {
            "model": ["1", 0], "plan": ["2", 0], "prompt": PROMPT + ", on a beach", "seed": 7, "steps": 0,
            "width": res, "height": res, "lora": ["5", 0], "strength": 1.0, "before_and_after": True,
            "clip": ["3", 0], "vae": ["4", 0]}},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", type=Path, required=True, help="folder with the files `model_files.py klein-folder` wrote")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--resolution", type=int, default=512)
    ap.add_argument("--skip-workflow", action="store_true")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))    # `timeout`: still stop the server, write results
    args.out.mkdir(parents=True, exist_ok=True)
    comfyui = Path(os.environ["COMFYUI_PATH"]).resolve()
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"ugpum_k9_{os.getpid()}"
    server = ComfyServer(comfyui, work)
    for rel in (f"diffusion_models/{DIT}", f"text_encoders/{TE}", f"vae/{VAE}"):
        (server.models / rel).symlink_to((args.models / rel).resolve())
    results: dict = {"comfyui": str(comfyui), "steps": args.steps, "resolution": args.resolution, "phases": []}
    monitor = None
    failures = 0
    try:
        t0 = time.time()
        server.start()
        results["server_start_s"] = round(time.time() - t0, 1)
        monitor = Monitor(server)
        monitor.phase = "idle"
        monitor.start()
        time.sleep(1.0)

        def phase(name: str, prompt: dict | None, timeout: float = 400) -> dict | None:
            nonlocal failures
            monitor.mark(name)
            t = time.time()
            entry = None
            record = {"phase": name}
            if prompt is None:               # a /free
                server.post_json("/free", {"unload_models": True, "free_memory": True})
                time.sleep(3.0)
                record["ok"] = True
            else:
                try:
                    entry = server.run(prompt, timeout=timeout)
                    err = execution_error(entry)
                    record["ok"] = err is None and entry["status"]["status_str"] == "success"
                    if err:
                        record["error"] = {k: err.get(k) for k in ("node_id", "node_type", "exception_type",
                                                                    "exception_message", "traceback")}
                except Exception as e:       # noqa: BLE001
                    record["ok"], record["error"] = False, repr(e)[-4000:]
            record["seconds"] = round(time.time() - t, 1)
            failures += not record["ok"]
            results["phases"].append(record)
            print(f"--- {name}: {'ok' if record['ok'] else 'FAILED'} in {record['seconds']} s", flush=True)
            if not record["ok"]:
                print(json.dumps(record.get("error"), indent=1)[:6000], flush=True)
            if entry is not None:
                for node, out in entry.get("outputs", {}).items():
                    if "text" in out:
                        print(f"[node {node}]\n" + "\n".join(out["text"])[:3000], flush=True)
            return entry

        phase("stock_before", stock_branch(None, "stock_before", args.resolution))
        phase("freed_before", None)
        phase("ugpum", ugpum_chain("klein9b_gpu", args.steps, args.resolution), timeout=600)
        phase("freed_after", None)
        lora = {"class_type": "LoraLoaderModelOnly", "inputs": {"lora_name": "ugpum/klein9b_gpu.safetensors",
                                                                "strength_model": 1.0}}
        phase("stock_after", stock_branch(lora, "stock_after", args.resolution))
        if not args.skip_workflow:
            prompt = ugpum_chain("klein9b_gpu_wf", 2, args.resolution)
            del prompt["8"]
            prompt.update(stock_branch({"class_type": "LoraModelLoader", "inputs": {
                "lora": ["5", 0], "strength_model": 1.0, "bypass": False}}, "workflow", args.resolution))
            phase("workflow", prompt, timeout=600)
        phase("freed_end", None)
        monitor.mark("done")
    finally:
        if monitor is not None:
            monitor.stop_event.set()
            monitor.join(timeout=2)
            results["samples"] = monitor.samples
        server.stop()
        (args.out / "comfyui_klein9b.log").write_text(server.log())
        summary = summarise(results.get("samples", []))
        results["summary"] = summary
        results["failures"] = failures
        (args.out / "klein9b_gpu.json").write_text(json.dumps(results, indent=1))
        print_table(summary)
    return 1 if failures else 0


def summarise(samples: list[dict]) -> list[dict]:
    keys = ("nvml_used_gib", "torch_reserved_gib", "torch_allocated_gib", "comfy_vram_free_gib")
    phases: list[dict] = []
    for s in samples:
        if "boundary" in s:
            continue
        if not phases or phases[-1]["phase"] != s["phase"]:
            phases.append({"phase": s["phase"], "samples": []})
        phases[-1]["samples"].append(s)
    ends = {s["boundary"][len("end of "):]: s for s in samples if "boundary" in s}
    out = []
    for p in phases:
        row = {"phase": p["phase"], "n": len(p["samples"])}
        for k in keys:
            vals = [s[k] for s in p["samples"] if k in s]
            if vals:
                agg = min if k == "comfy_vram_free_gib" else max
                row[("min_" if agg is min else "peak_") + k] = round(agg(vals), 2)
            end = ends.get(p["phase"], {})
            if k in end:
                row["end_" + k] = round(end[k], 2)
        out.append(row)
    return out


def print_table(summary: list[dict]) -> None:
    cols = ["peak_nvml_used_gib", "end_nvml_used_gib", "peak_torch_allocated_gib", "end_torch_allocated_gib",
            "peak_torch_reserved_gib", "end_torch_reserved_gib", "min_comfy_vram_free_gib", "end_comfy_vram_free_gib"]
    print("| phase | " + " | ".join(c.replace("_gib", "") for c in cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for row in summary:
        print(f"| {row['phase']} | " + " | ".join(str(row.get(c, "")) for c in cols) + " |")


if __name__ == "__main__":
    sys.exit(main())
