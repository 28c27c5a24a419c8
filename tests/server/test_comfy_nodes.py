"""The node pack inside a real ComfyUI server (tests/support/comfy_server.py): it imports cleanly, /object_info
shows the four nodes as declared, Loader -> Planner runs on real-format files, errors reach the user
as sentences, and every bundled workflow only uses nodes and widget values the server accepts."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from support.comfy_server import PACK_DIR_NAME, REPO, comfy_server_factory, execution_error  # noqa: F401  (fixture)
from support.comfy_models import flux2_state_dict_keys, wan_state_dict_keys

WORKFLOWS = sorted((REPO / "example_workflows").glob("*.json"))
WAN14B_FP8_FILE = "wan2.1_t2v_14B_fp8_scaled.safetensors"     # header only, sparse (workflow server)
TINY_FILE = "tiny-flux2.safetensors"
TINY_WAN_FILE = "tiny-wan.safetensors"
KLEIN_BASE_FILE = "flux-2-klein-base-9b-fp8.safetensors"      # header only, sparse
WAN_FILE = "wan2.1_t2v_1.3B_fp16.safetensors"                  # header only; its encoders are absent
KLEIN_FILE = "flux-2-klein-9b-fp8.safetensors"                # header only, sparse
BROKEN_FILE = "not-a-model.safetensors"
TEXT_ENCODER_FILE = "qwen_3_8b_fp8mixed.safetensors"          # names only: combos must list them
VAE_FILE = "flux2-vae.safetensors"

# The contract of the four nodes: inputs (required, optional) as name -> type, outputs as (type, name).
NODE_CONTRACT = {
    "UGPUMLoader": dict(
        required={"dit_name": "COMBO", "weight_dtype": "COMBO", "devices": "STRING"}, optional={},
        outputs=[("UGPUM_MODEL", "model")], output_node=False),
    "UGPUMPartitionPlanner": dict(
        required={"model": "UGPUM_MODEL", "resolution": "INT", "batch": "INT", "grad_accum": "INT",
                  "rank": "INT", "recompute": "COMBO"},
        optional={"frames": "INT", "schedule": "COMBO", "manual_split": "STRING", "base_compute": "COMBO",
                  "replicas": "INT"},
        outputs=[("UGPUM_PLAN", "plan"), ("STRING", "report")], output_node=True),
    "UGPUMLoRATrainer": dict(
        required={"model": "UGPUM_MODEL", "plan": "UGPUM_PLAN", "dataset": "COMBO", "trigger_word": "STRING",
                  "steps": "INT", "learning_rate": "FLOAT", "alpha": "FLOAT", "seed": "INT",
                  "sample_prompt": "STRING", "sample_every": "INT", "save_name": "STRING"},
        optional={"clip": "CLIP", "vae": "VAE", "frame_stride": "INT", "resume": "BOOLEAN", "timesteps": "COMBO",
                  "compile": "COMBO"},
        outputs=[("LORA_MODEL", "lora"), ("STRING", "lora file"), ("IMAGE", "loss curve"),
                 ("IMAGE", "before / after")], output_node=True),
    "UGPUMSamplePreview": dict(
        required={"model": "UGPUM_MODEL", "plan": "UGPUM_PLAN",
                  "prompt": "STRING", "seed": "INT", "steps": "INT", "width": "INT", "height": "INT"},
        optional={"frames": "INT", "lora": "LORA_MODEL", "strength": "FLOAT", "before_and_after": "BOOLEAN",
                  "clip": "CLIP", "vae": "VAE"},
        outputs=[("IMAGE", "images")], output_node=True),
}


# ------------------------------------------------------------------------------------ model files

def _file_key(key: str) -> str:
    """ComfyUI 0.33 names the q/k RMSNorm scales '.weight'; FLUX.2 files store them as '.scale'."""
    if key.endswith(("query_norm.weight", "key_norm.weight")):
        return key[: -len("weight")] + "scale"
    return key


def write_tiny(path: Path, model_id: str = "tiny-flux2", dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
    """A real-format tiny model file: ComfyUI's own module's state dict, seeded random values."""
    from comfy_bridge import build_meta, init_random
    from ugpum.arch import get_spec
    from ugpum.formats.safetensors_writer import write_streaming

    module = build_meta(get_spec(model_id), torch.float32).to_empty(device="cpu")
    init_random(module, seed)
    tensors = {_file_key(k): v for k, v in module.state_dict().items()}
    shapes = {k: (tuple(v.shape), dtype if v.is_floating_point() else v.dtype) for k, v in tensors.items()}
    write_streaming(path, shapes, lambda name, shape, dt: tensors[name])


def write_header_only(path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """A safetensors file with a real header and a sparse (unwritten) data section of the right size."""
    sizes = {"F8_E4M3": 1, "BF16": 2, "F32": 4}
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = sizes[dtype]
        for s in shape:
            n *= s
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)


def klein9b_fp8_header() -> dict[str, tuple[str, tuple[int, ...]]]:
    return {k: ("F8_E4M3" if "blocks." in k and len(s) == 2 else "BF16", s)
            for k, s in flux2_state_dict_keys("klein-9b").items()}


def prepare_models(models: Path, input_dir: Path) -> None:
    write_tiny(models / "diffusion_models" / TINY_FILE)
    write_tiny(models / "diffusion_models" / TINY_WAN_FILE, "tiny-wan")
    write_header_only(models / "diffusion_models" / KLEIN_BASE_FILE, klein9b_fp8_header())
    write_header_only(models / "diffusion_models" / KLEIN_FILE, klein9b_fp8_header())
    write_header_only(models / "diffusion_models" / WAN_FILE,
                      {k: ("BF16", s) for k, s in wan_state_dict_keys("t2v-1.3b").items()})
    (models / "diffusion_models" / BROKEN_FILE).write_bytes(b"this is not a safetensors file")
    (models / "text_encoders" / TEXT_ENCODER_FILE).write_bytes(b"")
    (models / "vae" / VAE_FILE).write_bytes(b"")


@pytest.fixture(scope="module")
def server(comfy_server_factory):
    return comfy_server_factory(prepare=prepare_models)


# ------------------------------------------------------------------------------------ helpers

def loader(name: str, devices: str = "auto", dtype: str = "as stored") -> dict:
    return {"class_type": "UGPUMLoader", "inputs": {"dit_name": name, "weight_dtype": dtype, "devices": devices}}


def planner(model_ref: list, resolution: int = 1024, **kw) -> dict:
    inputs = dict(model=model_ref, resolution=resolution, batch=1, grad_accum=1, rank=16, recompute="auto")
    inputs.update(kw)
    return {"class_type": "UGPUMPartitionPlanner", "inputs": inputs}


def ui_text(entry: dict, node_id: str) -> str:
    return "\n".join(entry["outputs"][node_id]["text"])


def assert_success(entry: dict, server) -> None:
    error = execution_error(entry)
    assert error is None and entry["status"]["status_str"] == "success", (
        json.dumps(error, indent=1) if error else json.dumps(entry["status"], indent=1)) + "\n" + server.log_tail()


# ------------------------------------------------------------------------------------ tests

def test_pack_imports_cleanly(server):
    log = server.log()
    assert PACK_DIR_NAME in log, "ComfyUI did not list the pack in its custom-node import times:\n" + log[-3000:]
    for line in log.splitlines():
        if PACK_DIR_NAME in line:
            assert "IMPORT FAILED" not in line, log[-6000:]
    assert "Cannot import" not in log and "Traceback" not in log, log[-6000:]
    assert "ugpum_comfyui/pyproject.toml" not in log


def test_object_info_lists_the_four_nodes(server):
    info = server.object_info()
    for node_id, contract in NODE_CONTRACT.items():
        assert node_id in info, f"{node_id} missing from /object_info"
        node = info[node_id]
        assert node["category"] == "UGPUM" and node["display_name"].startswith("UGPUM ")
        assert node["description"]
        for section in ("required", "optional"):
            declared = node["input"].get(section, {})
            assert list(declared) == list(contract[section]), (node_id, section, list(declared))
            assert node["input_order"].get(section, []) == list(contract[section])
            for name, kind in contract[section].items():
                assert declared[name][0] == kind, (node_id, name, declared[name][0])
        assert list(zip(node["output"], node["output_name"])) == contract["outputs"], node_id
        assert node["output_node"] is contract["output_node"], node_id
    loader_info = info["UGPUMLoader"]["input"]["required"]
    assert TINY_FILE in loader_info["dit_name"][1]["options"]
    assert BROKEN_FILE in loader_info["dit_name"][1]["options"]       # the list is not pre-filtered by content
    assert loader_info["weight_dtype"][1]["options"] == ["as stored", "bf16", "fp8_e4m3fn"]
    datasets = info["UGPUMLoRATrainer"]["input"]["required"]["dataset"][1]["options"]
    assert {"demo/loranne", "demo/rolwayne"} <= set(datasets)


def test_loader_and_planner_on_a_tiny_flux2_file(server):
    prompt = {"1": loader(TINY_FILE, dtype="bf16"),
              "2": planner(["1", 0], resolution=256, grad_accum=2, rank=4)}
    entry = server.run(prompt, timeout=90)
    assert_success(entry, server)
    described = ui_text(entry, "1")
    assert "tiny-flux2" in described and "M parameters" in described
    assert "5 blocks (2 double, 3 single)" in described and "weights fp32 -> bf16" in described
    report = ui_text(entry, "2")
    assert report.startswith("tiny-flux2  256x256  batch 1  grad-accum 2  rank 4  bf16  recompute auto")
    assert "recompute auto: 5 of 5 blocks keep their activations" in report     # the host's memory holds them
    assert "forecast / budget GiB" in report and "CPU run: no step-time forecast" in report   # (a CPU plan)
    assert "double_blocks.0" in report and "single_blocks.2" in report   # all 5 blocks are placed


def test_planner_forecasts_klein9b_for_described_gpus(server):
    """A full-size klein 9B header (sparse file) planned for two RTX 4090s that are not here."""
    entry = server.run({"1": loader(KLEIN_BASE_FILE, devices="rtx4090, rtx4090"),
                        "2": planner(["1", 0], grad_accum=4)}, timeout=90)
    assert_success(entry, server)
    assert "flux2-klein-base-9b" in ui_text(entry, "1") and "weights fp8" in ui_text(entry, "1")
    report = ui_text(entry, "2")
    assert report.startswith("flux2-klein-base-9b  1024x1024  batch 1  grad-accum 4  rank 16  fp8")
    assert report.count("rtx4090") >= 3                       # a replica on each + the table's one card
    table = report.split("layouts weighed (* the plan above):\n", 1)[1]
    assert "  split over 2 GPUs " in table and "* 2 replicas " in table and "  one card (rtx4090) " in table


@pytest.mark.parametrize("schedule", ["auto", "sequential", "gpipe", "1f1b"])
def test_planner_node_and_command_line_plan_alike(server, capsys, schedule):
    """The same inputs give the same plan (memory with the micro-batches in flight included): the
    Partition Planner's report equals `python -m ugpum plan`'s for two described RTX 4090s."""
    from ugpum.commands import main
    entry = server.run({"1": loader(KLEIN_BASE_FILE, devices="rtx4090, rtx4090"),
                        "2": planner(["1", 0], grad_accum=4, schedule=schedule)}, timeout=90)
    assert_success(entry, server)
    path = server.models / "diffusion_models" / KLEIN_BASE_FILE
    assert main(["plan", "--model", str(path), "--gpu", "rtx4090", "--gpu", "rtx4090", "--grad-accum", "4",
                 "--dtype", "fp8", "--schedule", schedule]) == 0
    cli = capsys.readouterr().out.strip()
    assert ui_text(entry, "2").strip() == cli
    if schedule != "auto":
        assert f"micro-batch schedule: {schedule}" in cli


def _plan_without_budgets(path: Path) -> dict:
    """A run's plan.json, less what is read off the host's free memory at that moment."""
    plan = json.loads(path.read_text())
    for stage in plan["stages"]:
        stage.pop("budget_gib")
    return plan


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_trainer_node_and_command_line_train_the_same_plan(server, tmp_path, schedule):
    """Two CPU stages, 4 micro-batches: the plan the Trainer node trained with (its run folder's
    plan.json) is the one `python -m ugpum train` trains with for the same settings."""
    prompt = {"1": loader(TINY_FILE, devices="cpu, cpu"),
              "2": planner(["1", 0], resolution=64, rank=4, grad_accum=4, schedule=schedule),
              "3": trainer(f"tiny_plan_{schedule}", 1)}
    entry = server.run(prompt, timeout=300)
    assert_success(entry, server)
    node_plan = _plan_without_budgets(server.output_dir / "ugpum" / f"tiny_plan_{schedule}" / "plan.json")
    out = tmp_path / "cli"
    done = subprocess.run([sys.executable, "-m", "ugpum", "train", "--profile", "tiny-flux2", "--dataset",
                           str(REPO / "demo_datasets" / "loranne"), "--devices", "cpu,cpu", "--grad-accum", "4",
                           "--schedule", schedule, "--steps", "1", "--sample-every", "0", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (node_plan["schedule"], node_plan["in_flight"]) == (schedule, 4 if schedule == "gpipe" else 2)
    assert node_plan == _plan_without_budgets(out / "plan.json")


def test_trainer_node_trains_replicas_as_one_device_does(server):
    """Two CPU devices as replicas (the Planner's replicas = 2, issue 40): the LoRA Trainer node trains the
    LoRA one device trains with the same global batch, bit for bit, in ComfyUI's one process."""
    def run(save_name: str, devices: str, replicas: int) -> dict:
        entry = server.run({"1": loader(TINY_FILE, devices=devices),
                            "2": planner(["1", 0], resolution=64, rank=4, grad_accum=2, replicas=replicas),
                            "3": trainer(save_name, 2)}, timeout=300)
        assert_success(entry, server)
        return entry
    two = run("tiny_replicas", "cpu, cpu", 2)
    assert "replica 2: cpu" in ui_text(two, "2") and "A CPU run (cpu, cpu) as 2 replicas" in ui_text(two, "2")
    plan = json.loads((server.output_dir / "ugpum" / "tiny_replicas" / "plan.json").read_text())
    assert plan["shares"] == [1, 1] and len(plan["replicas"]) == 2
    run("tiny_one_device", "cpu", 0)
    folder = server.base / "models" / "loras" / "ugpum"
    one, both = load_lora(folder / "tiny_one_device.safetensors"), load_lora(folder / "tiny_replicas.safetensors")
    assert one.keys() == both.keys() and all(torch.equal(one[k], both[k]) for k in one)


def test_loader_names_missing_companion_files_and_the_download_command(server):
    entry = server.run({"1": loader(WAN_FILE, devices="16GiB"), "2": planner(["1", 0])}, timeout=60)
    assert_success(entry, server)
    text = ui_text(entry, "1")
    assert "wan2.1-1.3b" in text
    assert "text_encoders/umt5_xxl_fp8_e4m3fn_scaled.safetensors" in text and "vae/wan_2.1_vae.safetensors" in text
    assert "python -m ugpum download wan2.1-1.3b" in text
    klein = server.run({"1": loader(KLEIN_BASE_FILE, devices="rtx4090, rtx4090"), "2": planner(["1", 0])},
                       timeout=60)                                                        # encoders present
    assert "Also needed" not in ui_text(klein, "1")


def test_a_file_that_is_no_model_is_refused_when_queued(server):
    """The Loader reads the file's header when the prompt is queued (`validate_inputs`): nothing runs."""
    refused = server.refused({"1": loader(BROKEN_FILE), "2": planner(["1", 0])})
    assert list(refused) == ["1"] and len(refused["1"]) == 1, refused
    message = refused["1"][0]
    assert message.startswith(f"dit_name - UGPUM Loader: Cannot read '{BROKEN_FILE}': not a safetensors file"), message
    assert "\n" not in message.strip() and message.strip().endswith("."), message


@pytest.mark.parametrize("prompt, node, expected", [
    ({"1": loader(KLEIN_BASE_FILE, devices="8GiB"), "2": planner(["1", 0], recompute="none")}, "2",
     "Partition Planner: flux2-klein-base-9b does not fit on 1 device(s)"),
    ({"1": loader(TINY_FILE, devices="rtx4090, gtx9000"), "2": planner(["1", 0])}, "1",
     "UGPUM Loader: unknown device spec 'gtx9000'"),
], ids=["does-not-fit", "device-typo"])
def test_errors_reach_the_user_as_sentences(server, prompt, node, expected):
    entry = server.run(prompt, timeout=60)
    error = execution_error(entry)
    assert error is not None, json.dumps(entry["status"], indent=1)
    assert error["node_id"] == node and error["exception_type"].endswith("UGPUMError"), error
    message = error["exception_message"]
    assert message.startswith(expected), message
    assert "\n" not in message.strip() and message.strip().endswith("."), message


# ------------------------------------------------------------------------------------ training

def trainer(save_name: str, steps: int, **kw) -> dict:
    inputs = dict(model=["1", 0], plan=["2", 0], dataset="demo/loranne", trigger_word="loranne", steps=steps,
                  learning_rate=1e-3, alpha=4.0, seed=1, sample_prompt="loranne, waving", sample_every=0,
                  save_name=save_name)
    inputs.update(kw)
    return {"class_type": "UGPUMLoRATrainer", "inputs": inputs}


def tiny_training_prompt(save_name: str, steps: int) -> dict:
    """Loader -> Planner -> Trainer on the tiny FLUX.2 (fp32 file, CPU, 64 px, stand-in encoders)."""
    return {"1": loader(TINY_FILE), "2": planner(["1", 0], resolution=64, rank=4), "3": trainer(save_name, steps)}


def load_lora(path: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(path))


def test_trainer_writes_a_lora_comfyui_lists(server):
    prompt = tiny_training_prompt("tiny_loranne", steps=2)
    prompt["4"] = {"class_type": "UGPUMSamplePreview",          # the trained LoRA, rendered on the split model
                   "inputs": dict(model=["1", 0], plan=["2", 0], prompt="loranne, waving", seed=3, steps=0,
                                  width=256, height=256, lora=["3", 0], strength=1.0, before_and_after=True)}
    entry = server.run(prompt, timeout=300)
    assert_success(entry, server)
    on_gpu = os.environ.get("UGPUM_TEST_COMFYUI_GPU") == "1"          # ComfyUI started without --cpu
    plan_rows = ui_text(entry, "2").split("\ndevice ", 1)[1].splitlines()[2:]        # under the header and its rule
    assert plan_rows[0].startswith("cuda:0" if on_gpu else "cpu"), ui_text(entry, "2")
    previews = entry["outputs"]["4"]["images"]
    assert len(previews) == 2                                   # before and after, same seed
    saved = server.base / "models" / "loras" / "ugpum" / "tiny_loranne.safetensors"
    assert saved.is_file()
    tensors = load_lora(saved)
    assert any(k.startswith("diffusion_model.double_blocks.0.img_attn.qkv.lora_A") for k in tensors)
    assert {t.shape[0] for k, t in tensors.items() if ".lora_A." in k} == {4}          # the plan's rank
    assert "saved ugpum/tiny_loranne.safetensors: 2 steps" in ui_text(entry, "3")
    run = server.output_dir / "ugpum" / "tiny_loranne"
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    lora_list = server.get_json("/models/loras")       # what every LoRA loader lists
    assert "ugpum/tiny_loranne.safetensors" in lora_list


def test_sample_preview_renders_a_wan_clip_as_frames(server):
    """frames 0 takes the plan's 4k+1 frames; every frame is an image of the output batch."""
    def preview(frames: int) -> dict:
        return {"1": loader(TINY_WAN_FILE), "2": planner(["1", 0], resolution=256, rank=4, frames=5),
                "3": {"class_type": "UGPUMSamplePreview",
                      "inputs": dict(model=["1", 0], plan=["2", 0], prompt="a red bar grows", seed=3, steps=2,
                                     width=256, height=256, frames=frames)}}
    entry = server.run(preview(0), timeout=120)
    assert_success(entry, server)
    frames = entry["outputs"]["3"]["images"]
    assert len(frames) == 5 and len({f["filename"] for f in frames}) == 5
    from PIL import Image
    pictures = [Image.open(server.base / "temp" / f["subfolder"] / f["filename"]) for f in frames]
    assert {p.size for p in pictures} == {(256, 256)}
    assert pictures[0].tobytes() != pictures[1].tobytes()            # latent frame 0 is frame 0 alone
    error = execution_error(server.run(preview(3), timeout=60))
    assert error and "frames = 3: Wan takes 4k+1 frames" in error["exception_message"], error


def test_the_planners_batch_reaches_the_trainer(server):
    prompt = {"1": loader(TINY_FILE), "2": planner(["1", 0], resolution=64, rank=4, batch=2),
              "3": trainer("tiny_batch2", 2, resume=True)}                 # a first run: nothing to resume
    entry = server.run(prompt, timeout=300)
    assert_success(entry, server)
    assert ui_text(entry, "2").startswith("tiny-flux2  64x64  batch 2")
    assert ("saved ugpum/tiny_batch2.safetensors: 2 steps (no checkpoint to resume from: started over)"
            in ui_text(entry, "3"))


def test_trainer_takes_every_nth_clip_frame(server):
    """The Trainer's frame stride reaches the dataset: the demo clips hold 33 frames, enough for 17
    frames at stride 2 (1 + 16 x 2), not at stride 3, and the error says which clip and what to do."""
    def clip_training(save_name: str, stride: int) -> dict:
        return {"1": loader(TINY_WAN_FILE), "2": planner(["1", 0], resolution=64, rank=4, frames=17),
                "3": trainer(save_name, 1, dataset="demo/loranne_clips", frame_stride=stride)}
    entry = server.run(clip_training("tiny_stride2", 2), timeout=300)
    assert_success(entry, server)
    assert "saved ugpum/tiny_stride2.safetensors: 1 step," in ui_text(entry, "3")
    error = execution_error(server.run(clip_training("tiny_stride3", 3), timeout=300))
    assert error, "stride 3 needs 49 frames of 33-frame clips"
    message = error["exception_message"]
    assert "loranne_clip_01.mp4" in message and "17 frames at stride 3 (49 frames)" in message, message
    assert "lower the frame stride" in message, message
    assert not (server.base / "models" / "loras" / "ugpum" / "tiny_stride3.safetensors").exists()


def test_cancel_during_training_saves_a_loadable_lora(server):
    prompt_id = server.queue(tiny_training_prompt("tiny_cancel", steps=100000))
    metrics = server.output_dir / "ugpum" / "tiny_cancel" / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        assert time.monotonic() < deadline, "training did not start:\n" + server.log_tail()
        time.sleep(0.2)
    server.interrupt()
    entry = server.wait(prompt_id, timeout=120)
    kinds = [kind for kind, _ in entry["status"]["messages"]]
    assert "execution_interrupted" in kinds, kinds
    saved = sorted((server.base / "models" / "loras" / "ugpum").glob("tiny_cancel_step*.safetensors"))
    assert saved, "no partial LoRA next to the others:\n" + server.log_tail()
    step = int(saved[-1].stem.rsplit("step", 1)[1])
    assert step >= 2 and load_lora(saved[-1])
    assert list((metrics.parent / "checkpoints").iterdir()), "no checkpoint to resume from"
    # queued again with resume on: it continues from that checkpoint, two steps further
    prompt = tiny_training_prompt("tiny_cancel", steps=step + 2)
    prompt["3"]["inputs"]["resume"] = True
    entry = server.run(prompt, timeout=300)
    assert_success(entry, server)
    assert f"saved ugpum/tiny_cancel.safetensors: {step + 2} steps (resumed at step {step})" in ui_text(entry, "3")
    assert [json.loads(l)["step"] for l in metrics.read_text().splitlines()] == list(range(1, step + 3))


def test_a_save_name_taken_by_an_earlier_run_is_refused_and_resume_continues_only_that_run(server):
    assert_success(server.run(tiny_training_prompt("tiny_taken", steps=2), timeout=300), server)
    saved = server.base / "models" / "loras" / "ugpum" / "tiny_taken.safetensors"
    before = saved.read_bytes()
    error = execution_error(server.run(tiny_training_prompt("tiny_taken", steps=3), timeout=120))
    assert error and "save name 'tiny_taken' is taken by an earlier run" in error["exception_message"], error
    assert "turn on resume" in error["exception_message"] and saved.read_bytes() == before
    # resume with another rank: refused by name, nothing changed
    other = tiny_training_prompt("tiny_taken", steps=3)
    other["2"]["inputs"]["rank"] = 8
    other["3"]["inputs"]["resume"] = True
    error = execution_error(server.run(other, timeout=120))
    assert error and "rank (4 in the checkpoint, 8 now)" in error["exception_message"], error
    assert saved.read_bytes() == before
    # resume with more steps: it continues
    more = tiny_training_prompt("tiny_taken", steps=3)
    more["3"]["inputs"]["resume"] = True
    entry = server.run(more, timeout=300)
    assert_success(entry, server)
    assert "3 steps (resumed at step 2)" in ui_text(entry, "3")


# ------------------------------------------------------------------------------------ workflow

FRONTEND_ONLY = {"Note", "MarkdownNote", "Reroute", "PrimitiveNode"}
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
CONTROL_VALUES = {"fixed", "increment", "decrement", "randomize"}


def widget_inputs(node_info: dict) -> list[tuple[str, str, dict]]:
    """(name, type, options) of every input the frontend shows as a widget, in widgets_values order."""
    out = []
    for section in ("required", "optional"):
        for name in node_info["input_order"].get(section, []):
            kind, *rest = node_info["input"][section][name]
            opts = rest[0] if rest else {}
            if isinstance(kind, list):                      # old-style combo: the options list itself
                kind, opts = "COMBO", dict(opts, options=kind)
            if kind in WIDGET_TYPES and not opts.get("forceInput"):
                out.append((name, kind, opts))
    return out


def has_control_widget(name: str, opts: dict) -> bool:
    # the frontend adds a "control after generate" value after seeds (explicitly, or by legacy name)
    return bool(opts.get("control_after_generate", name in ("seed", "noise_seed")))


def check_widget(node_type: str, name: str, kind: str, opts: dict, value) -> None:
    where = f"{node_type}.{name} = {value!r}"
    if kind == "COMBO":
        assert value in opts["options"], f"{where}: not one of {opts['options'][:20]}"
    elif kind == "INT":
        assert isinstance(value, int) and not isinstance(value, bool), where
    elif kind == "FLOAT":
        assert isinstance(value, (int, float)) and not isinstance(value, bool), where
    elif kind == "STRING":
        assert isinstance(value, str), where
    elif kind == "BOOLEAN":
        assert isinstance(value, bool), where
    if kind in ("INT", "FLOAT"):
        low, high = opts.get("min", value), opts.get("max", value)
        assert low <= value <= high, f"{where}: outside [{low}, {high}]"


def prepare_catalog_models(models: Path, input_dir: Path) -> None:
    """Every file of the model catalog (what `python -m ugpum download` fetches) by name, as empty
    placeholders (the workflows' loader combos must list them), and the Wan 14B fp8 DiT as a real
    header, which the Loader and Planner read."""
    from ugpum.catalog.models import MODELS
    for entry in MODELS.values():
        for f in entry.all_files():
            f.dest(models).parent.mkdir(parents=True, exist_ok=True)
            f.dest(models).touch()
    write_header_only(models / "diffusion_models" / WAN14B_FP8_FILE,
                      {k: ("F8_E4M3" if "blocks." in k and len(s) == 2 else "BF16", s)
                       for k, s in wan_state_dict_keys("t2v-14b").items()})


@pytest.fixture(scope="module")
def workflow_server(comfy_server_factory):
    return comfy_server_factory(prepare=prepare_catalog_models)


def test_every_workflow_has_a_thumbnail_and_a_known_model():
    from ugpum.catalog.models import MODELS
    catalog_dits = {f.filename for entry in MODELS.values() for f in entry.dit.values()}
    assert {w.name for w in WORKFLOWS} >= {"ugpum_klein9b_lora.json", "ugpum_wan14b_lora.json"}
    for path in WORKFLOWS:
        assert path.with_suffix(".jpg").is_file(), f"{path.name} has no thumbnail"
        loaders = [n for n in json.loads(path.read_text())["nodes"] if n["type"] == "UGPUMLoader"]
        assert loaders and all(n["widgets_values"][0] in catalog_dits for n in loaders), path.name


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_example_workflow_uses_existing_nodes_with_valid_widget_values(workflow_server, path):
    workflow = json.loads(path.read_text())
    info = workflow_server.object_info()
    nodes = {n["id"]: n for n in workflow["nodes"]}
    types = {n["type"] for n in nodes.values()}
    assert set(NODE_CONTRACT) <= types
    assert {"CLIPLoader", "VAELoader", "UNETLoader", "LoraModelLoader", "VAEDecode"} <= types
    assert types & {"SaveImage", "SaveAnimatedWEBP", "SaveWEBM", "SaveVideo"}
    for node in nodes.values():
        if node["type"] in FRONTEND_ONLY:
            continue
        assert node["type"] in info, f"node type {node['type']} is not known to this ComfyUI"
        spec = info[node["type"]]
        values = list(node.get("widgets_values") or [])
        expected = []
        for name, kind, opts in widget_inputs(spec):
            expected.append((name, kind, opts))
            if kind == "INT" and has_control_widget(name, opts):
                expected.append((name + ":control", "CONTROL", {}))
        if node["type"] in NODE_CONTRACT:
            assert len(values) == len(expected), (node["type"], values, [e[0] for e in expected])
        else:
            # The workflow targets the newest ComfyUI (klein needs it). The frontend fills widgets a
            # file lacks with their defaults and drops values for widgets a server does not have, so
            # a stock node may differ at the end, by widgets added or removed upstream, never before.
            assert abs(len(values) - len(expected)) <= 1, (node["type"], values, [e[0] for e in expected])
        for (name, kind, opts), value in zip(expected, values):
            if kind == "CONTROL":
                assert value in CONTROL_VALUES, (node["type"], name, value)
            else:
                check_widget(node["type"], name, kind, opts, value)
    # every link joins an output to an input of the same type, at slots that exist
    for link_id, origin, origin_slot, target, target_slot, kind in workflow["links"]:
        out_types = info[nodes[origin]["type"]]["output"]
        assert out_types[origin_slot] == kind, (link_id, out_types, kind)
        target_input = nodes[target]["inputs"][target_slot]
        assert target_input["link"] == link_id and target_input["type"] in (kind, "*"), (link_id, target_input)
        spec = info[nodes[target]["type"]]["input"]
        declared = {**spec.get("required", {}), **spec.get("optional", {})}[target_input["name"]][0]
        assert declared in (kind, "*"), (link_id, target_input["name"], declared, kind)
        assert link_id in nodes[origin]["outputs"][origin_slot]["links"]
    # the trained LoRA feeds the stock LoRA loader of the inference branch
    lora_links = [l for l in workflow["links"] if l[5] == "LORA_MODEL"]
    assert {nodes[l[3]]["type"] for l in lora_links} >= {"LoraModelLoader", "UGPUMSamplePreview"}
    assert all(nodes[l[1]]["type"] == "UGPUMLoRATrainer" for l in lora_links)


def test_wan_workflow_trains_clips_with_the_stock_wan_loaders(workflow_server):
    """The Wan 14B workflow: umT5 through CLIPLoader type wan, the Wan VAE, 4k+1 frames on the Planner,
    a clip dataset, and ComfyUI's Wan shift (8) and video latent in the inference branch."""
    from ugpum.catalog.models import MODELS
    wan = MODELS["wan2.1-14b"]
    nodes = {n["type"]: n for n in json.loads((REPO / "example_workflows" / "ugpum_wan14b_lora.json").read_text())["nodes"]}
    assert nodes["CLIPLoader"]["widgets_values"][:2] == [wan.text_encoder.filename, "wan"]
    assert nodes["VAELoader"]["widgets_values"] == [wan.vae.filename]
    resolution, frames = nodes["UGPUMPartitionPlanner"]["widgets_values"][0], nodes["UGPUMPartitionPlanner"]["widgets_values"][5]
    assert frames > 1 and (frames - 1) % 4 == 0
    assert nodes["ModelSamplingSD3"]["widgets_values"] == [8.0]
    width, height, length, _ = nodes["EmptyHunyuanLatentVideo"]["widgets_values"]
    assert (width, height) == (832, 480) and (length - 1) % 4 == 0
    dataset = nodes["UGPUMLoRATrainer"]["widgets_values"][0]
    from ugpum.train.video import folder_has_clips
    assert folder_has_clips(REPO / "demo_datasets" / dataset.removeprefix("demo/"))
    # its Loader and Planner run on the real-format 14B header: the forecast states the frames
    entry = workflow_server.run({"1": loader(WAN14B_FP8_FILE, devices="16GiB, 16GiB"),
                                 "2": planner(["1", 0], resolution=resolution, frames=frames, rank=32,
                                              grad_accum=4)}, timeout=90)
    assert_success(entry, workflow_server)
    report = ui_text(entry, "2")
    assert report.startswith(f"wan2.1-14b  {resolution}x{resolution}, {frames} frames ({1 + (frames - 1) // 4} "
                             "latent)  batch 1  grad-accum 4  rank 32  fp8"), report
    assert "blocks.39" in report and "predicted:" in report
