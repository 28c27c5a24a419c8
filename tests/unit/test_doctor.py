"""`ugpum doctor`: a sensible report and exit 0 without a GPU; GPU, ComfyUI and model-file sections
from what it finds; a broken section never stops the report."""
import argparse
import json
from pathlib import Path

import pytest

from ugpum.planning import devices
from ugpum.commands import doctor
from ugpum.planning.devices import GIB, Device
from support.cli_run import main_here
from support.comfyui_tree import comfyui_tree, safetensors_file


@pytest.fixture
def fake_comfyui(tmp_path, monkeypatch):
    """A folder that looks like ComfyUI 0.3.99, with a models/ folder holding klein 9B's VAE."""
    root = comfyui_tree(tmp_path / "ComfyUI", "0.3.99")
    safetensors_file(root / "models" / "vae" / "flux2-vae.safetensors")
    (root / "models" / "diffusion_models").mkdir()
    (root / "models" / "diffusion_models" / "my_finetune.safetensors").write_bytes(b"not a safetensors file")
    monkeypatch.setenv("COMFYUI_PATH", str(root))
    return root


@pytest.fixture
def no_gpu(monkeypatch):
    """As a machine without a GPU looks (also when the tests run on one)."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr(devices, "detect_devices", lambda probe=True: [])
    monkeypatch.setattr(devices, "peer_access_matrix", lambda: [])


def run(argv, capsys) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    doctor.add_doctor_parser(parser.add_subparsers(dest="command"))
    rc = doctor.run_doctor(parser.parse_args(["doctor", *argv]))
    return rc, capsys.readouterr().out


def test_without_gpu_the_report_is_sensible_and_exits_0(fake_comfyui, no_gpu, capsys):
    rc, out = run([], capsys)
    assert rc == 0
    assert "torch " in out and "CUDA available: no" in out
    assert "none: torch sees no CUDA device" in out
    assert str(fake_comfyui) in out and "version 0.3.99 (found by COMFYUI_PATH)" in out
    # model files in the found ComfyUI's models/ folder
    assert "[x] vae/flux2-vae.safetensors" in out
    assert "[ ] diffusion_models/flux-2-klein-9b.safetensors  (bf16, gated)" in out
    assert f"get it: python -m ugpum download flux2-klein-9b --models {fake_comfyui / 'models'}" in out
    assert "diffusion_models/my_finetune.safetensors: not FLUX.2 / Wan 2.1" in out
    # the klein 9B plan on typical rigs, with forecasts
    assert "profile klein-9b-1024: flux2-klein-base-9b, bf16 weights, 1024x1024" in out
    assert "== 1x RTX 4090" in out and "== 2x 16 GiB" in out
    assert out.count("predicted:") == 2 and "s/step" in out


def test_json_report(fake_comfyui, no_gpu, capsys, tmp_path):
    models = tmp_path / "elsewhere"
    safetensors_file(models / "text_encoders" / "qwen_3_8b_fp8mixed.safetensors")
    rc, out = run(["--json", "--models", str(models)], capsys)
    report = json.loads(out)
    assert rc == 0
    assert report["gpus"]["count"] == 0 and report["comfyui"]["version"] == "0.3.99"
    assert report["models"]["dir"] == str(models)
    klein = next(m for m in report["models"]["models"] if m["id"] == "flux2-klein-9b")
    present = {f["file"] for f in klein["files"] if f["present"]}
    assert present == {"text_encoders/qwen_3_8b_fp8mixed.safetensors"} and klein["ready"] == []
    rigs = report["plan"]["rigs"]
    assert [r["here"] for r in rigs] == [False, False]
    assert all(r["predicted_step_s"] > 0 for r in rigs)


def test_ready_model_and_version_from_pyproject(tmp_path, no_gpu, capsys, monkeypatch):
    root = comfyui_tree(tmp_path / "ComfyUI")
    (root / "comfyui_version.py").unlink()
    (root / "pyproject.toml").write_text('[project]\nname = "ComfyUI"\nversion = "0.33.0"\n')
    models = root / "models"
    for rel in ("diffusion_models/flux-2-klein-9b-fp8.safetensors", "text_encoders/qwen_3_8b_fp8mixed.safetensors",
                "vae/flux2-vae.safetensors"):
        safetensors_file(models / rel)
    monkeypatch.delenv("COMFYUI_PATH", raising=False)
    rc, out = run(["--models", str(models)], capsys)
    assert rc == 0
    assert "version 0.33.0 (found by the ComfyUI around --models)" in out
    assert "flux2-klein-9b: ready (fp8)" in out
    assert "get it: python -m ugpum download flux2-klein-9b " in out   # the default (bf16) DiT is missing


def test_with_gpus_shows_links_peer_access_and_the_plan_here(fake_comfyui, monkeypatch, capsys):
    def card(i: int) -> Device:
        return Device(label=f"cuda:{i} NVIDIA GeForce RTX 4080", torch_device=f"cuda:{i}", total_bytes=16 * GIB,
                      free_bytes=int(15.5 * GIB), tflops_bf16=78.0, host_gbps=25.0 if i == 0 else 6.5,
                      link="pcie4x16" if i == 0 else "pcie4x4", compute_capability=(8, 9), sm_count=76,
                      pcie_gen_max=4, pcie_gen_now=1, pcie_width_max=16 if i == 0 else 4,
                      pcie_width_now=16 if i == 0 else 4, pci_bus_id=f"0000:0{i + 1}:00.0")
    monkeypatch.setattr(devices, "detect_devices", lambda probe=True: [card(0), card(1)])
    monkeypatch.setattr(devices, "peer_access_matrix", lambda: [[True, False], [False, True]])
    rc, out = run([], capsys)
    assert rc == 0
    assert "cuda:0 NVIDIA GeForce RTX 4080: 16.0 GiB (15.5 free), compute 8.9" in out
    assert "PCIe gen 4 x16 max, gen 1 x16 now; link pcie4x16" in out
    assert "PCIe gen 4 x4 max, gen 1 x4 now; link pcie4x4" in out
    assert "cuda:0 -> cuda:1 no" in out and "staged through host memory" in out
    assert "== cuda:0 NVIDIA GeForce RTX 4080 + cuda:1 NVIDIA GeForce RTX 4080" in out
    assert "== cuda:0 NVIDIA GeForce RTX 4080 alone" in out
    assert "no GPU here" not in out


def test_a_broken_section_does_not_stop_the_report(fake_comfyui, monkeypatch, capsys):
    def broken(probe=True):
        raise RuntimeError("driver exploded")
    monkeypatch.setattr(devices, "detect_devices", broken)
    rc, out = run([], capsys)
    assert rc == 0
    assert "could not check: RuntimeError: driver exploded" in out
    assert "== 1x RTX 4090" in out                                      # the plan falls back to typical rigs
    assert "version 0.3.99" in out


def test_no_comfyui_and_no_models(tmp_path, no_gpu, monkeypatch, capsys):
    monkeypatch.delenv("COMFYUI_PATH", raising=False)
    monkeypatch.setattr(doctor, "find_comfyui_dir", lambda *args, **kwargs: None)
    rc, out = run([], capsys)
    assert rc == 0
    assert "not found: give --comfyui DIR or set COMFYUI_PATH" in out
    assert "no models folder: give --models <ComfyUI>/models" in out


def test_names_the_comfyui_train_uses_even_the_packaged_one_and_why_it_cannot_train_klein(tmp_path, no_gpu,
                                                                                        monkeypatch):
    """Without --comfyui, COMFYUI_PATH or a ComfyUI around --models, `train` falls back to the packaged
    ComfyUI; doctor names that same one, with what it cannot train and the fix. Its copy's models/ folder is
    never offered for downloads (they would be lost to the user's ComfyUI)."""
    import comfy_bridge
    monkeypatch.delenv("COMFYUI_PATH", raising=False)
    found = comfy_bridge.locate_comfyui()
    if found is None or not found.packaged:
        pytest.skip("no packaged ComfyUI installed")
    done = main_here("doctor")
    assert done.returncode == 0, done.stderr
    section = done.stdout.split("ComfyUI\n-------\n")[1].split("\n\n")[0]
    assert str(found.path) in section and f"the packaged ComfyUI {found.version}" in section
    assert "train and demo use it" in section
    if comfy_bridge.encoder_problem(found.packaged_from, "flux2-klein-base-9b"):
        assert "cannot load Flux.2-klein-base-9b's text encoder (Qwen3-8B)" in section
        assert "git clone https://github.com/Comfy-Org/ComfyUI" in section and "git pull" not in section
    assert "no models folder: give --models <ComfyUI>/models" in done.stdout


def test_doctor_and_train_name_the_same_comfyui(tmp_path, no_gpu, monkeypatch):
    """The ComfyUI around --models is the one used; doctor says so, and train refuses it, by the same path,
    before it looks for a single model file when it cannot load klein 9B's text encoder."""
    monkeypatch.delenv("COMFYUI_PATH", raising=False)
    old = comfyui_tree(tmp_path / "OldComfyUI", "0.3.75", new=False)
    doctor_out = main_here("doctor", "--models", str(old / "models")).stdout
    assert f"{old}\n  version 0.3.75 (found by the ComfyUI around --models); train and demo use this one" in doctor_out
    assert "cannot load Flux.2-klein-base-9b's text encoder (Qwen3-8B)" in doctor_out
    assert f"git -C {old} pull" in doctor_out
    new = comfyui_tree(tmp_path / "ComfyUI")
    assert f"{new}\n  version 0.33.0 (found by the ComfyUI around --models)" in \
        main_here("doctor", "--models", str(new / "models")).stdout
    assert "loads flux2-klein-base-9b's text encoder" in main_here("doctor", "--models", str(new / "models")).stdout


def test_a_comfyui_folder_that_is_not_there_is_said_not_passed_over(tmp_path, no_gpu, monkeypatch):
    monkeypatch.setenv("COMFYUI_PATH", str(comfyui_tree(tmp_path / "ComfyUI")))
    done = main_here("doctor", "--comfyui", str(tmp_path / "nowhere"))
    assert done.returncode == 0
    section = done.stdout.split("ComfyUI\n-------\n")[1].split("\n\n")[0]
    assert section.strip() == (f"error: --comfyui {tmp_path / 'nowhere'}: no such folder; give the folder of your "
                               "ComfyUI (the one holding main.py and comfy/), or get a ComfyUI from 2026 or newer "
                               "(git clone https://github.com/Comfy-Org/ComfyUI ~/ComfyUI && pip install -r "
                               "~/ComfyUI/requirements.txt, then export COMFYUI_PATH=~/ComfyUI)")
    monkeypatch.setenv("COMFYUI_PATH", str(tmp_path))
    assert f"error: COMFYUI_PATH={tmp_path} is not a ComfyUI folder" in main_here("doctor").stdout


def test_empty_or_cut_short_model_files_are_not_ready(tmp_path, no_gpu, monkeypatch):
    """File names are not trusted: a 0-byte file, or one whose header claims more than it holds, is shown as
    unusable (with the fix) and the model is not ready."""
    monkeypatch.delenv("COMFYUI_PATH", raising=False)
    models = comfyui_tree(tmp_path / "ComfyUI") / "models"
    names = ("diffusion_models/flux-2-klein-9b.safetensors", "text_encoders/qwen_3_8b_fp8mixed.safetensors",
             "vae/flux2-vae.safetensors")
    for rel in names:
        (models / rel).parent.mkdir(parents=True, exist_ok=True)
        (models / rel).write_bytes(b"")
    out = main_here("doctor", "--models", str(models)).stdout
    assert "flux2-klein-9b: not ready" in out and "ready (bf16)" not in out
    assert "[!] vae/flux2-vae.safetensors  (cannot be used: empty (0 bytes); delete it and download it again)" in out
    for rel in names:
        safetensors_file(models / rel)
    assert "flux2-klein-9b: ready (bf16)" in main_here("doctor", "--models", str(models)).stdout
    vae = models / names[2]
    vae.write_bytes(vae.read_bytes()[:-8])                              # cut short
    out = main_here("doctor", "--models", str(models)).stdout
    assert "flux2-klein-9b: not ready" in out and "[!] vae/flux2-vae.safetensors" in out and "truncated" in out
    report = json.loads(main_here("doctor", "--models", str(models), "--json").stdout)
    klein = next(m for m in report["models"]["models"] if m["id"] == "flux2-klein-9b")
    assert klein["ready"] == [] and "truncated" in next(f for f in klein["files"] if f["file"] == names[2])["problem"]


def test_the_plan_is_the_plan_verbs_for_the_profile(fake_comfyui, no_gpu, capsys):
    """doctor's forecast for a rig is `plan --profile klein-9b-1024 --gpu ...` for the same GPUs, line for line."""
    from ugpum.commands import main
    rc, out = run(["--json"], capsys)
    rigs = json.loads(out)["plan"]["rigs"]
    assert main(["plan", "--profile", "klein-9b-1024", "--gpu", "rtx4090"]) == 0
    assert capsys.readouterr().out.strip() == rigs[0]["text"].strip()
    assert "compiled blocks, bf16 weights, base compute bf16, 1 micro-batch of batch 1 per step" in rigs[0]["assumes"]
