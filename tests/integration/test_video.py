"""Wan clip datasets: decoding (PyAV files and numbered-frame folders), the errors a user sees, latents
with Wan's time axis (stand-in and ComfyUI's own Wan VAE), and tiny-wan clip training end to end."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageSequence
from safetensors.torch import load_file

from comfy_bridge import find_comfyui
from ugpum.arch import get_spec
from ugpum.train.config import ConfigError, load_config
from ugpum.train.dataset import DatasetError
from ugpum.train.encoders import StandInEncoders
from ugpum.train.musubi_toml import load_musubi_toml
from ugpum.train.video import ClipItem, load_bucketed_clip, load_clip_folder, load_folder, read_frames

av = pytest.importorskip("av")
needs_comfy = pytest.mark.skipif(find_comfyui() is None, reason="needs ComfyUI's model classes")
QUIET = dict(log=lambda *a: None)
WAN, FLUX2 = get_spec("tiny-wan"), get_spec("tiny-flux2")
SIZE = (80, 48)                                   # width, height: a 5:3 clip, bucket (80, 48) at 64


def frame_pixels(i: int, size=SIZE) -> np.ndarray:
    """Frame i: grey level 20 + 10 i (readable back through a lossy codec) and a red bar i*5 wide."""
    a = np.full((size[1], size[0], 3), 20 + 10 * i, np.uint8)
    a[:, : (i * 5) % size[0], 0] = 255
    return a


def write_clip(path: Path, n: int, codec: str = "libx264", size=SIZE, caption: str | None = "a clip") -> Path:
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=16)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        if codec == "libx264":
            stream.options = {"crf": "0"}
        for i in range(n):
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame_pixels(i, size), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption)
    return path


def write_frame_folder(folder: Path, n: int, name=lambda i: f"frame_{i + 1}.png", caption="numbered frames"):
    folder.mkdir()
    for i in range(n):
        Image.fromarray(frame_pixels(i)).save(folder / name(i))
    folder.with_name(folder.name + ".txt").write_text(caption)
    return folder


def grey(image: Image.Image) -> float:
    return float(np.asarray(image)[..., 1].mean())          # green: untouched by the red bar


# ------------------------------------------------------------------------------ decoding


@pytest.mark.parametrize("name, codec", [("a.mp4", "libx264"), ("a.webm", "libvpx-vp9"), ("a.mkv", "ffv1"),
                                         ("a.mov", "mpeg4")])
def test_clip_files_give_every_stride_th_frame_from_the_start(tmp_path, name, codec):
    clip = write_clip(tmp_path / name, 12, codec)
    frames = read_frames(clip, 5, stride=2)
    assert len(frames) == 5 and frames[0].size == SIZE
    assert [grey(f) for f in frames] == pytest.approx([20, 40, 60, 80, 100], abs=4)   # frames 0, 2, 4, 6, 8


def test_frame_folder_is_read_in_frame_number_order(tmp_path):
    folder = write_frame_folder(tmp_path / "wave", 12)           # frame_1 .. frame_12: not alphabetical
    frames = read_frames(folder, 9)
    assert [grey(f) for f in frames] == pytest.approx([20 + 10 * i for i in range(9)], abs=0.5)


def test_a_clip_becomes_frames_by_3_by_bucket(tmp_path):
    clip = write_clip(tmp_path / "a.mp4", 9)
    pixels = load_bucketed_clip(ClipItem(clip, "", (64, 32), 1, 5, 2))         # wider bucket: crop top/bottom
    assert pixels.shape == (5, 3, 32, 64) and pixels.min() >= -1 and pixels.max() <= 1
    assert float(pixels[4, 1].mean()) == pytest.approx((20 + 80) / 127.5 - 1, abs=0.04)   # frame 8's grey


def test_demo_clip_set_is_a_480p_clip_dataset():
    demo = Path(__file__).resolve().parents[2] / "demo_datasets" / "loranne_clips"
    items = load_clip_folder(demo, WAN, frames=33, resolution=640, trigger="loranne")
    assert len(items) == 10 and all(isinstance(i, ClipItem) for i in items)
    assert {i.bucket for i in items} == {(832, 480)}
    assert all(i.caption.startswith("loranne, ") and "the camera slowly" in i.caption for i in items)


# ------------------------------------------------------------------------------ errors


def test_short_clip_names_the_file_its_length_and_the_fix(tmp_path):
    write_clip(tmp_path / "short.mp4", 10)
    with pytest.raises(DatasetError, match=r"short\.mp4 has 10 frame\(s\), but training takes 17 frames.*"
                                           r"set frames to 9 or fewer"):
        load_clip_folder(tmp_path, WAN, frames=17, resolution=64)
    with pytest.raises(DatasetError, match=r"takes 5 frames at stride 3 \(13 frames\).*lower the frame stride"):
        load_clip_folder(tmp_path, WAN, frames=5, stride=3, resolution=64)


def test_short_frame_folder_is_named(tmp_path):
    write_frame_folder(tmp_path / "wave", 4)
    with pytest.raises(DatasetError, match=r"frame folder .*wave has 4 frame\(s\)"):
        load_clip_folder(tmp_path, WAN, frames=5, resolution=64)


@pytest.mark.parametrize("content", [b"", b"this is not a video at all" * 100])
def test_undecodable_clip_is_named_with_what_to_do(tmp_path, content):
    (tmp_path / "broken.mp4").write_bytes(content)
    (tmp_path / "broken.txt").write_text("x")
    with pytest.raises(DatasetError, match=r"cannot (open|decode) video .*broken\.mp4.*re-encode it"):
        load_clip_folder(tmp_path, WAN, frames=5, resolution=64)


@pytest.mark.parametrize("frames", [2, 6, 16, 0])
def test_frames_must_be_4k_plus_1(tmp_path, frames):
    write_clip(tmp_path / "a.mp4", 20)
    with pytest.raises(DatasetError, match="4k\\+1"):
        load_clip_folder(tmp_path, WAN, frames=frames, resolution=64)
    with pytest.raises(ConfigError, match="frames.*4k\\+1"):
        load_config("tiny-wan-clip", overrides=dict(frames=frames))


def test_clips_for_a_flux2_model_are_refused(tmp_path):
    write_clip(tmp_path / "a.mp4", 9)
    with pytest.raises(DatasetError, match=r"holds video clips \(a\.mp4, \.\.\.\), but FLUX\.2 models train on images"):
        load_folder(tmp_path, FLUX2, frames=1, resolution=64)
    with pytest.raises(ConfigError, match="frames.*tiny-flux2 trains on images"):
        load_config("tiny-flux2", overrides=dict(frames=5))


def test_an_uncaptioned_sub_folder_of_images_is_not_a_clip(tmp_path):
    for i in range(2):
        Image.fromarray(frame_pixels(i)).save(tmp_path / f"p{i}.png")
        (tmp_path / f"p{i}.txt").write_text("a photo")
    (tmp_path / "raw").mkdir()
    Image.fromarray(frame_pixels(0)).save(tmp_path / "raw" / "IMG_0001.png")
    items = load_folder(tmp_path, FLUX2, frames=1, resolution=64)
    assert sorted(i.path.name for i in items) == ["p0.png", "p1.png"]
    write_frame_folder(tmp_path / "wave", 5)                 # captioned: a clip, refused for FLUX.2
    with pytest.raises(DatasetError, match=r"holds video clips \(wave, \.\.\.\)"):
        load_folder(tmp_path, FLUX2, frames=1, resolution=64)


def test_clips_with_frames_1_ask_for_frames(tmp_path):
    write_clip(tmp_path / "a.mp4", 9)
    with pytest.raises(DatasetError, match="holds clips .* but frames is 1; set frames to a count the model "
                                           "takes \\(e.g. 17 or 33\\)"):
        load_folder(tmp_path, WAN, frames=1, resolution=64)


def test_clip_without_caption_is_named(tmp_path):
    write_clip(tmp_path / "a.mp4", 9, caption=None)
    with pytest.raises(DatasetError, match=r"clip .*a\.mp4 has no caption file a\.txt"):
        load_clip_folder(tmp_path, WAN, frames=5, resolution=64)


def test_frame_folder_problems_are_named(tmp_path):
    write_frame_folder(tmp_path / "a", 5, name=lambda i: f"{'x' if i == 3 else i}.png")
    with pytest.raises(DatasetError, match=r"x\.png has no frame number"):
        load_clip_folder(tmp_path, WAN, frames=5, resolution=64)
    folder = write_frame_folder(tmp_path / "b", 0)
    Image.new("RGB", (80, 48)).save(folder / "1.png")
    Image.new("RGB", (64, 48)).save(folder / "2.png")
    with pytest.raises(DatasetError, match=r"2\.png is 64x48, the frames before it 80x48"):
        read_frames(folder, 5)


# ------------------------------------------------------------------------------ latents


def test_stand_in_encoder_compresses_time_like_wan():
    enc = StandInEncoders(get_spec("tiny-wan"))
    frames = torch.rand(9, 3, 32, 64) * 2 - 1
    latent = enc.encode_video(frames)
    assert latent.shape == (1, 16, 3, 4, 8)
    torch.testing.assert_close(latent[:, :, :1], enc.encode_images(frames[:1]))      # first frame alone
    torch.testing.assert_close(latent[:, :, 2:], enc.encode_images(frames[5:9].mean(0, keepdim=True)))
    with pytest.raises(ValueError, match="4k\\+1"):
        enc.encode_video(frames[:4])


def test_stand_in_decoder_gives_a_clips_frames():
    """A clip's latent decodes to 4k+1 frames (ComfyUI's VAEDecode batch): frame 0 from latent frame 0,
    then each later latent frame for the four frames it stands for."""
    enc = StandInEncoders(get_spec("tiny-wan"))
    frames = torch.rand(9, 3, 32, 64) * 2 - 1
    latent = enc.encode_video(frames)
    decoded = enc.decode(latent)
    assert decoded.shape == frames.shape
    torch.testing.assert_close(decoded[:1], enc.decode(latent[:, :, 0]))
    for i in range(1, 5):
        torch.testing.assert_close(decoded[i], decoded[1])
    assert not torch.equal(decoded[0], decoded[1]) and not torch.equal(decoded[4], decoded[5])
    with pytest.raises(ValueError, match="one clip"):
        enc.decode(latent.repeat(2, 1, 1, 1, 1))


@needs_comfy
def test_comfyui_wan_vae_encodes_a_clip_along_its_time_axis():
    """ComfyUI's own Wan 2.1 VAE class (tiny width, random weights) through ComfyEncoders: 9 frames
    become 3 latent frames, the first of which is the first frame encoded alone (the VAE is causal)."""
    from support import comfy_models as cm
    cm.import_comfy(cm.find_comfyui())
    import comfy.ldm.wan.vae
    import comfy.sd
    from comfy_bridge import ComfyEncoders
    module = comfy.ldm.wan.vae.WanVAE(dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                                      temperal_downsample=[False, True, True])
    g = torch.Generator().manual_seed(0)
    sd = {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in module.state_dict().items()}
    vae = comfy.sd.VAE(sd=sd)                                   # detected as the Wan 2.1 VAE by its keys

    class TextEncoderUnused:                                    # encode_video never touches the text encoder
        cond_stage_model = torch.nn.Linear(1, 1)
    enc = ComfyEncoders(TextEncoderUnused(), vae, get_spec("tiny-wan"))
    frames = torch.rand(9, 3, 48, 80, generator=g) * 2 - 1
    with torch.no_grad():
        latent = enc.encode_video(frames)
        first = enc.encode_images(frames[:1])
        decoded = enc.decode(latent)
        first_decoded = enc.decode(first)
    assert latent.shape == (1, 16, 3, 6, 10)
    torch.testing.assert_close(latent[:, :, :1], first, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(latent[:, :, 1], latent[:, :, 2])
    assert decoded.shape == (9, 3, 48, 80)                      # the clip's frames, as VAEDecode batches them
    assert first_decoded.shape == (1, 3, 48, 80)


# ------------------------------------------------------------------------------ training


def clip_dataset(root: Path) -> Path:
    data = root / "clips"
    data.mkdir()
    write_clip(data / "bar.mp4", 12, caption="a red bar grows")
    write_clip(data / "bar_vp9.webm", 9, "libvpx-vp9", caption="a red bar grows, vp9")
    write_frame_folder(data / "frames", 10, caption="numbered frames of a red bar")
    Image.fromarray(frame_pixels(3)).save(data / "still.png")                 # an image trains as one frame
    (data / "still.txt").write_text("a still frame")
    return data


@needs_comfy
def test_tiny_wan_clip_training_end_to_end(tmp_path):
    from ugpum.commands.train import run_training as train
    data = clip_dataset(tmp_path)
    cfg = load_config("tiny-wan-clip", overrides=dict(dataset=str(data), devices=["cpu"], frames=9, steps=12,
                                                      sample_every=6, trigger="barclip"))
    result = train(cfg, tmp_path / "out", **QUIET)
    assert result.steps_done == 12 and all(np.isfinite(result.losses))
    assert result.validation_after < result.validation_before
    tensors = load_file(str(result.lora_path))
    assert {k for k in tensors if k.startswith("diffusion_model.blocks.0.self_attn.q.lora_")} == {
        "diffusion_model.blocks.0.self_attn.q.lora_A.weight", "diffusion_model.blocks.0.self_attn.q.lora_B.weight"}
    shapes = sorted(tuple(load_file(str(p))["value"].shape) for p in (tmp_path / "out/cache/latents").iterdir())
    assert shapes == [(16, 1, 6, 10)] + [(16, 3, 6, 10)] * 3      # the image, then 3 clips of 9 frames
    with Image.open(result.samples[0]) as preview:
        assert preview.size == SIZE                               # rendered at the clips' bucket
    with Image.open(result.samples[-1].with_suffix(".webp")) as clip:    # the whole sampled clip, at 16 fps
        durations = []
        for frame in ImageSequence.Iterator(clip):
            frame.load()                                  # Pillow reads a frame's duration with its pixels
            durations.append(frame.info["duration"])
        assert clip.size == SIZE and clip.is_animated      # (WebP merges the stand-in's repeated frames)
        assert sum(durations) == 9 * round(1000 / 16)
    # the same run again is served from the cache; another stride reads other frames: new latents
    cache = str(tmp_path / "shared_cache")
    first = train(load_config("tiny-wan-clip", overrides=dict(dataset=str(data), devices=["cpu"], steps=1,
                                                              sample_every=0, cache_dir=cache)), tmp_path / "a", **QUIET)
    second = train(load_config("tiny-wan-clip", overrides=dict(dataset=str(data), devices=["cpu"], steps=1,
                                                               sample_every=0, cache_dir=cache)), tmp_path / "b", **QUIET)
    strided = train(load_config("tiny-wan-clip", overrides=dict(dataset=str(data), devices=["cpu"], steps=1,
                                                                sample_every=0, cache_dir=cache, frame_stride=2)),
                    tmp_path / "c", **QUIET)
    assert first.cache_misses == 8 and second.cache_misses == 0   # 4 latents + 4 captions
    assert strided.cache_misses == 3                                              # the 3 clips, not the image


# ------------------------------------------------------------------------------ musubi-tuner TOML

def video_toml(root: Path, body: str) -> Path:
    clips = root / "clips"
    clips.mkdir(parents=True)
    write_clip(clips / "bar.mp4", 20, caption="a red bar grows")
    write_frame_folder(clips / "wave", 20)
    Image.fromarray(frame_pixels(0)).save(clips / "still.png")        # an image_directory's business
    config = root / "clips.toml"
    config.write_text('[general]\nresolution = [96, 64]\n\n[[datasets]]\nvideo_directory = "clips"\n' + body)
    return config


def test_musubi_video_dataset_gives_each_clips_head_per_target_frames(tmp_path):
    config = video_toml(tmp_path, "target_frames = [1, 9]\nsource_fps = 32.0\nnum_repeats = 2\n")
    items = load_musubi_toml(config, spec=WAN, frames=9)
    bucket = (96, 64)                                     # musubi's default: no bucketing, the resolution
    assert [(i.path.name, i.frames, i.stride, i.bucket) for i in items] == (
        [("bar.mp4", 1, 2, bucket)] * 2 + [("wave", 1, 2, bucket)] * 2 + [("bar.mp4", 9, 2, bucket)] * 2
        + [("wave", 9, 2, bucket)] * 2)                   # 32 fps: every 2nd frame, Wan's 16 fps
    pixels = load_bucketed_clip(items[4])
    levels = [float(((f[1] + 1) * 127.5).mean()) for f in pixels]      # green channel: 20 + 10 i
    assert [round((g - 20) / 10) for g in levels] == list(range(0, 17, 2))
    # without target_frames: the run's frames; without source_fps: the run's stride
    (bar, wave) = load_musubi_toml(video_toml(tmp_path / "b", ""), spec=WAN, frames=5, stride=3)
    assert (bar.frames, bar.stride, wave.frames) == (5, 3, 5)


@pytest.mark.parametrize("body, message", [
    ("target_frames = [13]\n", "target_frames holds 13, more than the 9 frames this run is planned for; set frames to 13"),
    ("target_frames = [8]\n", "4k\\+1"),
    ("target_frames = 17\n", "target_frames must be a list"),
    ('frame_extraction = "chunk"\n', "frame_extraction = 'chunk': UGPUM takes each clip's first frames"),
    ("frame_stride = 2\n", "'frame_stride': it belongs to a frame_extraction other than \"head\""),
    ("max_frames = 45\n", "'max_frames': it belongs"),
    ("source_fps = 30.0\n", "source_fps = 30 is not a whole multiple of Wan 2.1's 16 fps"),
    ("source_fps = 8.0\n", "source_fps must be a frame rate of at least 16"),
    ('video_jsonl_file = "m.jsonl"\n', "'video_jsonl_file': metadata JSONL files are not supported"),
    ("source_fps = inf\n", "source_fps must be a frame rate"),
    ("target_frames = [9]\nsource_fps = 48.0\n", "bar.mp4 has 20 frame\\(s\\), but training takes 9 frames at stride 3 \\(25 "
     "frames\\) from its start; set .*clips.toml \\[\\[datasets\\]\\] #1's target_frames to 5 or fewer, lower "
     ".*clips.toml \\[\\[datasets\\]\\] #1's source_fps"),
])
def test_musubi_video_dataset_problems_name_the_toml_and_the_fix(tmp_path, body, message):
    config = video_toml(tmp_path, body)
    with pytest.raises(DatasetError, match=message) as caught:
        load_musubi_toml(config, spec=WAN, frames=9)
    assert "clips.toml [[datasets]] #1" in str(caught.value)


def test_musubi_video_dataset_needs_a_wan_model_and_clip_frames(tmp_path):
    config = video_toml(tmp_path, "")
    with pytest.raises(DatasetError, match="video_directory trains Wan 2.1 models only; this run's model is flux2"):
        load_musubi_toml(config, spec=FLUX2, frames=1)
    with pytest.raises(DatasetError, match="this run's frames is 1; set frames to a count the model takes "
                                           "\\(e.g. 17\\)"):
        load_musubi_toml(config, spec=WAN, frames=1)


def test_musubi_target_frames_are_taken_once_each(tmp_path):
    items = load_musubi_toml(video_toml(tmp_path, "target_frames = [5, 1, 5]\n"), spec=WAN, frames=5)
    assert [(i.path.name, i.frames) for i in items] == [("bar.mp4", 5), ("wave", 5), ("bar.mp4", 1), ("wave", 1)]


@needs_comfy
def test_tiny_wan_trains_on_a_musubi_video_toml(tmp_path):
    from ugpum.commands.train import run_training as train
    config = video_toml(tmp_path, "target_frames = [1, 5]\n")
    cfg = load_config("tiny-wan-clip", overrides=dict(dataset=str(config), devices=["cpu"], frames=5, steps=4,
                                                      sample_every=0, resolution=96))   # the TOML's 96x64
    result = train(cfg, tmp_path / "out", **QUIET)
    assert result.steps_done == 4 and all(np.isfinite(result.losses))
    shapes = sorted(tuple(load_file(str(p))["value"].shape) for p in (tmp_path / "out/cache/latents").iterdir())
    assert shapes == [(16, 1, 8, 12)] * 2 + [(16, 2, 8, 12)] * 2   # each clip's first frame, and its first 5


@needs_comfy
def test_cli_trains_a_clip_lora_and_the_plan_states_the_frames(tmp_path, capsys):
    from ugpum.commands import main
    data = clip_dataset(tmp_path)
    out = tmp_path / "run"
    assert main(["train", "--profile", "tiny-wan-clip", "--dataset", str(data), "--devices", "cpu",
                 "--frames", "5", "--steps", "2", "--sample-every", "0", "--out", str(out)]) == 0
    assert (out / "ugpum_lora.safetensors").is_file()
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 2
    capsys.readouterr()
    assert main(["plan", "--model", "wan2.1-14b", "--frames", "33", "--resolution", "832x480",
                 "--gpu", "16GiB", "--gpu", "16GiB"]) == 0
    first_line = capsys.readouterr().out.splitlines()[0]
    assert first_line.startswith("wan2.1-14b  832x480, 33 frames (9 latent)  batch 1")
