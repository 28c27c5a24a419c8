"""Draws docs/icon.png, the pack's icon for the Comfy Registry (pyproject.toml [tool.comfy] Icon):
three GPU cards side by side, a model's blocks spread over them, on the pack's dark blue.
Run: python scripts/make_icon.py"""
from pathlib import Path

from PIL import Image, ImageDraw

SIZE = 400
OUT = Path(__file__).resolve().parents[1] / "docs" / "icon.png"


def main() -> Path:
    img = Image.new("RGB", (SIZE, SIZE), (22, 34, 58))
    d = ImageDraw.Draw(img)
    colors = [(86, 156, 214), (120, 200, 140), (236, 176, 84)]
    card_w, gap, top = 100, 20, 70
    left = (SIZE - 3 * card_w - 2 * gap) // 2
    for i, color in enumerate(colors):                       # one card per GPU, its blocks stacked inside
        x = left + i * (card_w + gap)
        d.rounded_rectangle([x, top, x + card_w, top + 220], radius=14, outline=(210, 220, 235), width=5)
        for j in range(4):
            y = top + 18 + j * 49
            d.rounded_rectangle([x + 16, y, x + card_w - 16, y + 34], radius=6, fill=color)
    for i in range(2):                                       # the hidden state crossing between GPUs
        x = left + card_w + i * (card_w + gap)
        d.polygon([(x + 3, 170), (x + gap - 3, 180), (x + 3, 190)], fill=(240, 240, 240))
    d.rounded_rectangle([left, 318, SIZE - left, 336], radius=9, fill=(240, 84, 84))       # the LoRA
    OUT.parent.mkdir(parents=True, exist_ok=True)
    img.save(OUT, optimize=True)
    return OUT


if __name__ == "__main__":
    print(main())
