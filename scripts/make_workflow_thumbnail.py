"""Draw the template thumbnail ComfyUI shows next to a bundled workflow: a schematic of the graph
(groups, nodes with their titles, links coloured by type) from the UI-format JSON, with Pillow alone.

    python scripts/make_workflow_thumbnail.py                     # every example_workflows/*.json
    python scripts/make_workflow_thumbnail.py FILE.json [OUT.jpg]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from PIL import Image, ImageDraw

REPO = Path(__file__).resolve().parent.parent
WIDTH = 768
TITLE_H = 26
LINK_COLOURS = {"UGPUM_MODEL": (250, 160, 60), "UGPUM_PLAN": (240, 110, 80), "LORA_MODEL": (120, 220, 120),
                "MODEL": (180, 160, 255), "CLIP": (255, 220, 90), "VAE": (255, 110, 110),
                "IMAGE": (100, 180, 255), "LATENT": (255, 150, 220), "CONDITIONING": (255, 170, 100)}
UGPUM_FILL, STOCK_FILL, NOTE_FILL = (70, 52, 34), (48, 48, 52), (44, 56, 44)


def draw(workflow: dict) -> Image.Image:
    nodes = workflow["nodes"]
    boxes = [(n["pos"][0], n["pos"][1] - TITLE_H, n["pos"][0] + n["size"][0], n["pos"][1] + n["size"][1])
             for n in nodes]
    boxes += [(g["bounding"][0], g["bounding"][1], g["bounding"][0] + g["bounding"][2],
               g["bounding"][1] + g["bounding"][3]) for g in workflow.get("groups", [])]
    x0, y0 = min(b[0] for b in boxes) - 20, min(b[1] for b in boxes) - 20
    x1, y1 = max(b[2] for b in boxes) + 20, max(b[3] for b in boxes) + 20
    scale = WIDTH / (x1 - x0)
    img = Image.new("RGB", (WIDTH, round((y1 - y0) * scale)), (30, 30, 34))
    d = ImageDraw.Draw(img)

    def p(x, y):
        return (x - x0) * scale, (y - y0) * scale

    for g in workflow.get("groups", []):
        gx, gy, gw, gh = g["bounding"]
        d.rectangle([p(gx, gy), p(gx + gw, gy + gh)], outline=(90, 110, 140), width=2)
        d.text(p(gx + 8, gy + 6), g["title"], fill=(170, 190, 220))
    by_id = {n["id"]: n for n in nodes}
    for _, src, src_slot, dst, dst_slot, kind in workflow["links"]:
        a, b = by_id[src], by_id[dst]
        start = p(a["pos"][0] + a["size"][0], a["pos"][1] + 14 + 20 * src_slot)
        end = p(b["pos"][0], b["pos"][1] + 14 + 20 * dst_slot)
        d.line([start, end], fill=LINK_COLOURS.get(kind, (200, 200, 200)), width=2)
    for n in nodes:
        left, top = p(n["pos"][0], n["pos"][1] - TITLE_H)
        right, bottom = p(n["pos"][0] + n["size"][0], n["pos"][1] + n["size"][1])
        fill = UGPUM_FILL if n["type"].startswith("UGPUM") else NOTE_FILL if "Note" in n["type"] else STOCK_FILL
        d.rounded_rectangle([left, top, right, bottom], radius=4, fill=fill, outline=(120, 120, 130))
        d.text((left + 4, top + 3), n.get("title") or n["type"], fill=(235, 235, 235))
    return img


def main(argv: list[str]) -> int:
    files = [Path(argv[0])] if argv else sorted((REPO / "example_workflows").glob("*.json"))
    for f in files:
        out = Path(argv[1]) if len(argv) > 1 else f.with_suffix(".jpg")
        draw(json.loads(f.read_text())).save(out, quality=88)
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
