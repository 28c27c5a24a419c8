"""Pictures for people: a loss curve and a before/after grid, drawn with Pillow alone."""
from __future__ import annotations

import torch
from PIL import Image, ImageDraw


def loss_curve(losses: list[float], width: int = 640, height: int = 360, smooth: int = 5) -> Image.Image:
    """Per-step loss (light) and its moving average (dark), with min/max labels."""
    img = Image.new("RGB", (width, height), "white")
    d = ImageDraw.Draw(img)
    left, right, top, bottom = 56, width - 16, 16, height - 32
    d.rectangle([left, top, right, bottom], outline=(160, 160, 160))
    if not losses:
        d.text((left + 8, top + 8), "no steps yet", fill="black")
        return img
    lo, hi = min(losses), max(losses)
    hi = hi if hi > lo else lo + 1e-6

    def point(i, v):
        x = left + (right - left) * (i / max(len(losses) - 1, 1))
        y = bottom - (bottom - top) * ((v - lo) / (hi - lo))
        return x, y

    d.line([point(i, v) for i, v in enumerate(losses)], fill=(170, 200, 240), width=1)
    avg = [sum(losses[max(0, i - smooth + 1):i + 1]) / len(losses[max(0, i - smooth + 1):i + 1])
           for i in range(len(losses))]
    d.line([point(i, v) for i, v in enumerate(avg)], fill=(20, 70, 160), width=2)
    d.text((4, top), f"{hi:.3f}", fill="black")
    d.text((4, bottom - 10), f"{lo:.3f}", fill="black")
    d.text((left, bottom + 8), f"step 1 .. {len(losses)}   (loss; dark: {smooth}-step average)", fill="black")
    return img


def to_pil(pixels: torch.Tensor) -> Image.Image:
    """[3,H,W] in [-1,1] -> PIL image."""
    arr = ((pixels.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    return Image.fromarray(arr)


def save_animation(frames: list[Image.Image], path, fps: int) -> None:
    """An endlessly looping animated WebP (Pillow writes it; browsers and ComfyUI show it)."""
    frames[0].save(path, format="WEBP", save_all=True, append_images=frames[1:], duration=round(1000 / fps),
                   loop=0, lossless=False, quality=90)


def grid(rows: list[tuple[str, list[Image.Image]]], cell: int = 256) -> Image.Image:
    """Labelled rows of images, e.g. [("before", [...]), ("after", [...])]."""
    cols = max(len(images) for _, images in rows)
    label_w = 80
    out = Image.new("RGB", (label_w + cols * cell, len(rows) * cell), "white")
    d = ImageDraw.Draw(out)
    for r, (label, images) in enumerate(rows):
        d.text((8, r * cell + cell // 2), label, fill="black")
        for c, im in enumerate(images):
            out.paste(im.resize((cell, cell), Image.NEAREST), (label_w + c * cell, r * cell))
    return out
