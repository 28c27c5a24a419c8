#!/usr/bin/env python3
"""Draw two small synthetic LoRA-training datasets of cartoon characters.

The pictures are drawn from scratch with Pillow and numpy drawing primitives
(no fonts, no downloaded assets, no randomness beyond fixed seeds), so running
the script twice gives byte-identical files:

    demo_datasets/loranne/loranne_01.jpg ... loranne_10.jpg  (+ .txt captions)
    demo_datasets/rolwayne/rolwayne_01.jpg ... rolwayne_10.jpg (+ .txt captions)

Characters
    loranne   a small cartoon woman: teal bob haircut, round yellow glasses,
              red scarf, purple coat, grey leggings, brown boots.
    rolwayne  a tall cartoon man: green top hat, bushy orange beard,
              blue-and-white striped shirt, brown trousers, black shoes.

Every image is 1024x1024, drawn at 2048x2048 and downsampled with LANCZOS for
anti-aliasing, saved as JPEG (quality 90) with a same-stem .txt caption that
starts with the trigger word.

Usage
    python scripts/make_demo_datasets.py                 # write into demo_datasets/
    python scripts/make_demo_datasets.py --out DIR       # write elsewhere
    python scripts/make_demo_datasets.py --check         # regenerate into a temp dir
                                                         # and compare sha256 with the
                                                         # files in demo_datasets/ (or --out)
    python scripts/make_demo_datasets.py --check --only loranne_01,rolwayne_03

Exit status of --check: 0 when every regenerated file matches, 1 otherwise
(mismatching, missing or unexpected extra files are listed). Generating all
20 images takes about 5 s on one CPU core.

JPEG bytes depend on the Pillow / libjpeg-turbo build. The committed files
were made with Pillow 13.0.0 and numpy 2.4.6; on a different Pillow build
--check may report mismatches (it prints the mean pixel difference) even
though the drawings are the same; then regenerate and commit.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "demo_datasets"

FINAL = 1024          # output size
SS = 2                # supersampling factor
S = FINAL * SS        # drawing canvas size
JPEG_QUALITY = 90

OUTLINE = (43, 34, 51)

# --------------------------------------------------------------------------
# small geometry helpers
# --------------------------------------------------------------------------

def _ellipse(cx, cy, rx, ry, n=72, a0=0.0, a1=2 * math.pi):
    pts = []
    for i in range(n + 1 if a1 - a0 < 2 * math.pi else n):
        a = a0 + (a1 - a0) * i / n
        pts.append((cx + rx * math.cos(a), cy + ry * math.sin(a)))
    return pts


def _capsule(p1, p2, r1, r2=None, n=18):
    """Rounded limb segment from p1 (radius r1) to p2 (radius r2)."""
    if r2 is None:
        r2 = r1
    dx, dy = p2[0] - p1[0], p2[1] - p1[1]
    ang = math.atan2(dy, dx)
    pts = []
    # half circle around p2 from ang-90 to ang+90
    for i in range(n + 1):
        a = ang - math.pi / 2 + math.pi * i / n
        pts.append((p2[0] + r2 * math.cos(a), p2[1] + r2 * math.sin(a)))
    for i in range(n + 1):
        a = ang + math.pi / 2 + math.pi * i / n
        pts.append((p1[0] + r1 * math.cos(a), p1[1] + r1 * math.sin(a)))
    return pts


def _rounded_rect(x0, y0, x1, y1, r, n=8):
    pts = []
    corners = [(x1 - r, y0 + r, -math.pi / 2), (x1 - r, y1 - r, 0.0),
               (x0 + r, y1 - r, math.pi / 2), (x0 + r, y0 + r, math.pi)]
    for cx, cy, a0 in corners:
        for i in range(n + 1):
            a = a0 + (math.pi / 2) * i / n
            pts.append((cx + r * math.cos(a), cy + r * math.sin(a)))
    return pts


def _lerp(a, b, t):
    return a + (b - a) * t


def _mix(c1, c2, t):
    return tuple(int(round(_lerp(a, b, t))) for a, b in zip(c1, c2))


def _ik(shoulder, target, l1, l2, bend):
    """Two-bone IK: elbow position for a limb reaching `target`.

    `bend` (+1/-1) picks on which side of the shoulder->target line the elbow
    sits (in drawing coordinates, y down). Returns (elbow, hand).
    """
    sx, sy = shoulder
    tx, ty = target
    dx, dy = tx - sx, ty - sy
    d = math.hypot(dx, dy)
    d = max(min(d, l1 + l2 - 1e-6), abs(l1 - l2) + 1e-6)
    a = (l1 * l1 - l2 * l2 + d * d) / (2 * d)
    h = math.sqrt(max(l1 * l1 - a * a, 0.0))
    ux, uy = dx / d, dy / d
    ex = sx + ux * a - bend * uy * h
    ey = sy + uy * a + bend * ux * h
    hx, hy = sx + ux * d, sy + uy * d
    return (ex, ey), (hx, hy)


# --------------------------------------------------------------------------
# Pen: affine transform from local (character) units onto the canvas
# --------------------------------------------------------------------------

class Pen:
    def __init__(self, draw: ImageDraw.ImageDraw, mat=None, line_px=6.0):
        self.d = draw
        # 2x3 affine matrix [[a, b, c], [d, e, f]]
        self.m = mat if mat is not None else (1.0, 0.0, 0.0, 0.0, 1.0, 0.0)
        self.line_px = line_px

    # transforms -----------------------------------------------------------
    def _compose(self, n):
        a, b, c, d, e, f = self.m
        A, B, C, D, E, F = n
        return (a * A + b * D, a * B + b * E, a * C + b * F + c,
                d * A + e * D, d * B + e * E, d * C + e * F + f)

    def sub(self, tx=0.0, ty=0.0, rot_deg=0.0, scale=1.0, mirror=False):
        """New pen: local = translate(tx,ty) . rotate . scale . (mirror x)."""
        r = math.radians(rot_deg)
        cs, sn = math.cos(r) * scale, math.sin(r) * scale
        mx = -1.0 if mirror else 1.0
        n = (cs * mx, -sn, tx, sn * mx, cs, ty)
        return Pen(self.d, self._compose(n), self.line_px)

    def scale_of(self):
        a, b, _, d, e, _ = self.m
        return math.sqrt(abs(a * e - b * d))

    def tr(self, pts):
        a, b, c, d, e, f = self.m
        return [(a * x + b * y + c, d * x + e * y + f) for x, y in pts]

    # drawing ------------------------------------------------------------
    def shapes(self, items, outline=OUTLINE, width=None):
        """Draw polygons (pts, fill): first all outline strokes, then fills.

        Drawing the strokes first and the fills on top gives one continuous
        outline around a group of overlapping shapes (e.g. a bent arm).
        """
        w = self.line_px * 2 if width is None else width
        if outline is not None and w > 0:
            for pts, _fill in items:
                t = self.tr(pts)
                self.d.line(t + [t[0]], fill=outline, width=int(round(w)), joint="curve")
                # round caps at every vertex are added by joint="curve"; close gap:
                r = w / 2
                x, y = t[0]
                self.d.ellipse((x - r, y - r, x + r, y + r), fill=outline)
        for pts, fill in items:
            self.d.polygon(self.tr(pts), fill=fill)

    def poly(self, pts, fill, outline=OUTLINE, width=None):
        self.shapes([(pts, fill)], outline, width)

    def fill(self, pts, fill):
        self.d.polygon(self.tr(pts), fill=fill)

    def line(self, pts, fill=OUTLINE, width_units=None, width_px=None, caps=True):
        t = self.tr(pts)
        if width_px is None:
            width_px = width_units * self.scale_of()
        w = max(1, int(round(width_px)))
        self.d.line(t, fill=fill, width=w, joint="curve")
        if caps:
            r = w / 2
            for x, y in (t[0], t[-1]):
                self.d.ellipse((x - r, y - r, x + r, y + r), fill=fill)


# --------------------------------------------------------------------------
# backgrounds (drawn straight onto the canvas, pixel coordinates)
# --------------------------------------------------------------------------

def _vgrad(img, y0, y1, c0, c1, x0=0, x1=S):
    """Vertical gradient on rows [y0, y1)."""
    y0, y1 = int(y0), int(y1)
    if y1 <= y0:
        return
    t = np.linspace(0.0, 1.0, y1 - y0)[:, None]
    col = np.array(c0, float)[None, :] * (1 - t) + np.array(c1, float)[None, :] * t
    block = np.repeat(np.round(col).astype(np.uint8)[:, None, :], x1 - x0, axis=1)
    img.paste(Image.fromarray(block, "RGB"), (x0, y0))


def _dgrad(img, c0, c1, angle_deg=35.0):
    """Diagonal full-canvas gradient."""
    a = math.radians(angle_deg)
    yy, xx = np.mgrid[0:S, 0:S].astype(np.float32) / (S - 1)
    t = (xx * math.cos(a) + yy * math.sin(a))
    t = (t - t.min()) / (t.max() - t.min())
    t = t[..., None]
    arr = np.array(c0, np.float32) * (1 - t) + np.array(c1, np.float32) * t
    img.paste(Image.fromarray(np.round(arr).astype(np.uint8), "RGB"), (0, 0))


def _radial(img, c_in, c_out, cx=0.5, cy=0.45):
    yy, xx = np.mgrid[0:S, 0:S].astype(np.float32) / (S - 1)
    t = np.sqrt((xx - cx) ** 2 + (yy - cy) ** 2) / 0.75
    t = np.clip(t, 0, 1)[..., None]
    arr = np.array(c_in, np.float32) * (1 - t) + np.array(c_out, np.float32) * t
    img.paste(Image.fromarray(np.round(arr).astype(np.uint8), "RGB"), (0, 0))


def _cloud(d, cx, cy, w, col=(255, 255, 255)):
    h = w * 0.32
    for ox, oy, r in ((-0.3, 0.05, 0.22), (0.0, -0.12, 0.3), (0.3, 0.02, 0.22), (0.12, 0.1, 0.25), (-0.12, 0.1, 0.25)):
        rr = r * w
        d.ellipse((cx + ox * w - rr, cy + oy * w - rr * 0.8, cx + ox * w + rr, cy + oy * w + rr * 0.8), fill=col)
    d.rectangle((cx - 0.42 * w, cy + 0.02 * w, cx + 0.42 * w, cy + h * 0.55), fill=col)


def _tree(d, x, ground, h):
    tw = h * 0.09
    d.rectangle((x - tw / 2, ground - h * 0.45, x + tw / 2, ground), fill=(120, 82, 52))
    greens = [(58, 140, 72), (72, 160, 84), (50, 125, 66)]
    for i, (ox, oy, r) in enumerate(((0, -0.7, 0.3), (-0.2, -0.55, 0.22), (0.2, -0.55, 0.22), (0, -0.88, 0.2))):
        rr = r * h
        d.ellipse((x + ox * h - rr, ground + oy * h - rr, x + ox * h + rr, ground + oy * h + rr),
                  fill=greens[i % 3])


def bg_meadow(img, d, horizon, rng):
    _vgrad(img, 0, horizon, (110, 180, 240), (205, 232, 250))
    d.ellipse((S * 0.78, S * 0.08, S * 0.92, S * 0.22), fill=(255, 226, 110))
    _cloud(d, S * 0.22, S * 0.16, S * 0.26)
    _cloud(d, S * 0.62, S * 0.27, S * 0.18)
    # hills
    d.ellipse((-S * 0.3, horizon - S * 0.12, S * 0.6, horizon + S * 0.4), fill=(126, 190, 104))
    d.ellipse((S * 0.35, horizon - S * 0.08, S * 1.3, horizon + S * 0.4), fill=(110, 178, 92))
    _vgrad(img, horizon + S * 0.04, S, (120, 186, 96), (84, 150, 70))
    _tree(d, S * 0.1, horizon + S * 0.05, S * 0.3)
    _tree(d, S * 0.88, horizon + S * 0.06, S * 0.26)
    for _ in range(40):
        x = rng.random() * S
        y = horizon + S * 0.07 + rng.random() * (S - horizon - S * 0.07)
        r = S * 0.004
        col = (255, 255, 255) if rng.random() < 0.5 else (250, 220, 80)
        d.ellipse((x - r, y - r, x + r, y + r), fill=col)
    return "in a sunny meadow with green hills and a blue sky"


def bg_city(img, d, horizon, rng):
    _vgrad(img, 0, horizon, (150, 200, 235), (230, 225, 215))
    palette = [(196, 120, 98), (170, 178, 196), (224, 196, 140), (150, 160, 170), (208, 150, 120), (120, 140, 170)]
    x = -S * 0.05
    i = 0
    while x < S:
        w = S * (0.12 + 0.1 * rng.random())
        h = S * (0.25 + 0.35 * rng.random())
        col = palette[i % len(palette)]
        d.rectangle((x, horizon - h, x + w, horizon), fill=col)
        win = _mix(col, (250, 240, 200), 0.55)
        cols = max(2, int(w / (S * 0.04)))
        gx = w / cols
        yy = horizon - h + S * 0.03
        while yy < horizon - S * 0.06:
            for c in range(cols):
                wx = x + c * gx + gx * 0.25
                d.rectangle((wx, yy, wx + gx * 0.5, yy + S * 0.035), fill=win)
            yy += S * 0.06
        x += w + S * 0.01
        i += 1
    # pavement and road
    _vgrad(img, horizon, horizon + S * 0.12, (190, 188, 184), (170, 168, 164))
    d.rectangle((0, horizon, S, horizon + S * 0.012), fill=(140, 138, 134))
    _vgrad(img, horizon + S * 0.12, S, (92, 94, 100), (70, 72, 78))
    y = horizon + S * 0.2
    for k in range(6):
        d.rectangle((k * S * 0.2, y, k * S * 0.2 + S * 0.1, y + S * 0.015), fill=(235, 230, 210))
    return "on a city street with colourful buildings"


def bg_room(img, d, horizon, rng):
    wall, floor = (236, 214, 180), (172, 120, 80)
    _vgrad(img, 0, horizon, _mix(wall, (255, 255, 255), 0.15), wall)
    # window
    wx0, wx1, wy0, wy1 = S * 0.58, S * 0.92, S * 0.1, horizon - S * 0.22
    d.rectangle((wx0 - S * 0.02, wy0 - S * 0.02, wx1 + S * 0.02, wy1 + S * 0.02), fill=(250, 250, 245))
    _vgrad(img, wy0, wy1, (120, 185, 240), (200, 230, 250), int(wx0), int(wx1))
    _cloud(d, (wx0 + wx1) / 2, wy0 + (wy1 - wy0) * 0.35, (wx1 - wx0) * 0.45)
    d.rectangle(((wx0 + wx1) / 2 - S * 0.008, wy0, (wx0 + wx1) / 2 + S * 0.008, wy1), fill=(250, 250, 245))
    d.rectangle((wx0, (wy0 + wy1) / 2 - S * 0.008, wx1, (wy0 + wy1) / 2 + S * 0.008), fill=(250, 250, 245))
    d.rectangle((wx0 - S * 0.035, wy1 + S * 0.02, wx1 + S * 0.035, wy1 + S * 0.045), fill=(225, 225, 218))
    # picture frame
    d.rectangle((S * 0.1, S * 0.14, S * 0.3, S * 0.3), fill=(110, 80, 60))
    d.rectangle((S * 0.115, S * 0.155, S * 0.285, S * 0.285), fill=(250, 236, 200))
    d.polygon([(S * 0.12, S * 0.28), (S * 0.18, S * 0.2), (S * 0.23, S * 0.26), (S * 0.25, S * 0.23), (S * 0.28, S * 0.28)],
              fill=(110, 160, 120))
    # skirting + floor boards
    _vgrad(img, horizon, S, floor, _mix(floor, (0, 0, 0), 0.2))
    d.rectangle((0, horizon - S * 0.02, S, horizon), fill=(250, 246, 236))
    for k in range(9):
        x = S * (k / 8.0)
        d.line([(S / 2 + (x - S / 2) * 0.3, horizon), (x + (x - S / 2) * 0.6, S)], fill=(140, 96, 62), width=4)
    # potted plant
    px = S * 0.12
    d.polygon([(px - S * 0.05, horizon + S * 0.02), (px + S * 0.05, horizon + S * 0.02),
               (px + S * 0.04, horizon + S * 0.1), (px - S * 0.04, horizon + S * 0.1)], fill=(200, 100, 70))
    for a in (-60, -30, 0, 30, 60):
        ang = math.radians(a - 90)
        ex, ey = px + math.cos(ang) * S * 0.12, horizon + S * 0.02 + math.sin(ang) * S * 0.13
        d.line([(px, horizon + S * 0.02), (ex, ey)], fill=(60, 140, 70), width=int(S * 0.012))
        d.ellipse((ex - S * 0.02, ey - S * 0.02, ex + S * 0.02, ey + S * 0.02), fill=(70, 155, 80))
    return "in a cosy room with a window"


def bg_beach(img, d, horizon, rng):
    sea_top = horizon - S * 0.08
    _vgrad(img, 0, sea_top, (250, 150, 110), (255, 214, 150))
    sun_r = S * 0.09
    d.ellipse((S * 0.3 - sun_r, sea_top - sun_r * 0.7, S * 0.3 + sun_r, sea_top + sun_r * 1.3), fill=(255, 236, 170))
    _vgrad(img, sea_top, horizon, (64, 120, 170), (90, 160, 190))
    for k in range(5):
        y = sea_top + (horizon - sea_top) * (0.15 + 0.17 * k)
        d.line([(S * 0.3 - S * 0.12 / (1 + k * 0.5), y), (S * 0.3 + S * 0.12 / (1 + k * 0.5), y)],
               fill=(255, 220, 160), width=max(2, int(S * 0.004)))
    _vgrad(img, horizon, S, (240, 214, 160), (224, 190, 130))
    d.line([(0, horizon + S * 0.01), (S * 0.3, horizon + S * 0.02), (S * 0.7, horizon + S * 0.005), (S, horizon + S * 0.015)],
           fill=(250, 250, 245), width=int(S * 0.01), joint="curve")
    for _ in range(6):
        x = rng.random() * S
        y = horizon + S * 0.08 + rng.random() * (S - horizon - S * 0.1)
        r = S * 0.008
        d.ellipse((x - r, y - r * 0.6, x + r, y + r * 0.6), fill=(250, 236, 220))
    return "on a beach at sunset"


def bg_night(img, d, horizon, rng):
    _vgrad(img, 0, horizon, (14, 20, 56), (60, 60, 120))
    for _ in range(140):
        x = rng.random() * S
        y = rng.random() * horizon * 0.95
        r = S * (0.0015 + 0.003 * rng.random())
        d.ellipse((x - r, y - r, x + r, y + r), fill=(255, 250, 220))
    # crescent moon
    mx, my, mr = S * 0.8, S * 0.17, S * 0.075
    outer = _ellipse(mx, my, mr, mr, 60, math.radians(60), math.radians(300))
    inner = _ellipse(mx - mr * 0.45, my - mr * 0.1, mr * 0.85, mr * 0.85, 60, math.radians(300), math.radians(60))
    d.polygon(outer + inner[::-1][1:-1], fill=(255, 240, 170))
    # hills silhouette
    d.ellipse((-S * 0.3, horizon - S * 0.1, S * 0.6, horizon + S * 0.5), fill=(34, 52, 70))
    d.ellipse((S * 0.3, horizon - S * 0.06, S * 1.3, horizon + S * 0.5), fill=(28, 44, 62))
    _vgrad(img, horizon + S * 0.05, S, (30, 48, 64), (18, 30, 44))
    return "outside at night under a starry sky with a crescent moon"


def _studio(colour, name):
    def bg(img, d, horizon, rng):
        _radial(img, _mix(colour, (255, 255, 255), 0.35), _mix(colour, (0, 0, 0), 0.12))
        return f"against a plain {name} studio background"
    return bg


def _gradient(c0, c1, name, angle=35.0):
    def bg(img, d, horizon, rng):
        _dgrad(img, c0, c1, angle)
        return f"on a {name} gradient background"
    return bg


def bg_snow(img, d, horizon, rng):
    _vgrad(img, 0, horizon, (170, 196, 222), (222, 232, 242))
    d.polygon([(-S * 0.1, horizon), (S * 0.25, horizon - S * 0.3), (S * 0.6, horizon)], fill=(150, 166, 190))
    d.polygon([(S * 0.16, horizon - S * 0.2), (S * 0.25, horizon - S * 0.3), (S * 0.34, horizon - S * 0.2)], fill=(250, 252, 255))
    d.polygon([(S * 0.4, horizon), (S * 0.78, horizon - S * 0.36), (S * 1.15, horizon)], fill=(136, 152, 178))
    d.polygon([(S * 0.67, horizon - S * 0.255), (S * 0.78, horizon - S * 0.36), (S * 0.89, horizon - S * 0.255)], fill=(250, 252, 255))
    _vgrad(img, horizon, S, (246, 249, 252), (220, 230, 240))
    for _ in range(90):
        x = rng.random() * S
        y = rng.random() * S
        r = S * (0.002 + 0.003 * rng.random())
        d.ellipse((x - r, y - r, x + r, y + r), fill=(255, 255, 255))
    return "in a snowy landscape with mountains"


BACKGROUNDS = {
    "meadow": bg_meadow,
    "city": bg_city,
    "room": bg_room,
    "beach": bg_beach,
    "night": bg_night,
    "snow": bg_snow,
    "studio_cream": _studio((246, 226, 180), "cream"),
    "studio_blue": _studio((170, 200, 236), "light blue"),
    "studio_pink": _studio((246, 190, 200), "pink"),
    "studio_grey": _studio((205, 205, 210), "light grey"),
    "grad_sunset": _gradient((255, 190, 120), (230, 110, 160), "peach-to-pink"),
    "grad_mint": _gradient((190, 240, 210), (120, 170, 230), "mint-to-blue", 60.0),
    "grad_lilac": _gradient((250, 230, 160), (190, 160, 230), "yellow-to-lilac", 110.0),
}


# --------------------------------------------------------------------------
# characters
# --------------------------------------------------------------------------

@dataclass
class Pose:
    # arm: ("ang", upper_deg, bend_deg) or ("ik", (x, y) hand target, "out"|"in")
    # angles: 0 = hanging down, 90 = horizontal outwards, 180 = straight up.
    arm_back: tuple = ("ang", 12, 8)      # arm on the character's back side (-x)
    arm_front: tuple = ("ang", 12, 8)     # arm on the character's front side (+x)
    legs: str = "stand"                   # stand | wide | jump | sit
    tilt: float = 0.0                     # head tilt, degrees (+ = clockwise)
    face: str = "smile"                   # smile | laugh | surprised | calm | wink
    wave_lines: str = ""                  # "", "back" or "front": motion lines by that hand
    point: str = ""                       # "", "back" or "front": index finger on that hand


@dataclass
class Shot:
    pose: Pose
    framing: str          # full | half | close
    background: str
    facing: int = 1       # +1 faces right (viewer's right), -1 faces left
    x_shift: float = 0.0  # horizontal placement, fraction of the frame
    pose_text: str = ""


@dataclass
class Body:
    height: float         # top of head (incl. hat) above ground, units
    head_y: float         # head centre
    head_r: float
    neck_y: float
    shoulder_y: float
    shoulder_x: float
    hip_y: float
    hip_x: float
    thigh: float
    shin: float
    upper_arm: float
    fore_arm: float
    arm_r: float
    leg_r: float
    extra: dict = field(default_factory=dict)


def _limb_chain(root, spec, l1, l2, side):
    """Joint positions for an arm/leg. side = -1 (back, -x) or +1 (front, +x)."""
    if spec[0] == "ik":
        # ("ik", (x, y), "out"|"in"): elbow pointing away from / towards the body
        (tx, ty), want = spec[1], spec[2]
        cands = [_ik(root, (tx, ty), l1, l2, bend) for bend in (1, -1)]
        cands.sort(key=lambda eh: side * eh[0][0], reverse=(want == "out"))
        return cands[0]
    _, a, b = spec
    a1 = math.radians(a)
    a2 = math.radians(a + b)
    elbow = (root[0] + side * math.sin(a1) * l1, root[1] + math.cos(a1) * l1)
    hand = (elbow[0] + side * math.sin(a2) * l2, elbow[1] + math.cos(a2) * l2)
    return elbow, hand


class Character:
    trigger = ""
    body: Body

    # pose -> skeleton ---------------------------------------------------
    def skeleton(self, pose: Pose):
        b = self.body
        lift = 0.0
        if pose.legs == "jump":
            lift = b.thigh * 0.55
        sk = {"lift": lift}
        if pose.legs == "sit":
            # 3/4 view: thighs point towards the facing side, shins hang down
            hip_y = -b.shin - 0.2
            sk["hip_y"] = hip_y
            for s in (-1, 1):
                off = 0.0 if s > 0 else -0.22
                hip = (s * b.hip_x * 0.5, hip_y + off)
                knee = (b.hip_x * 0.5 + b.thigh * 0.92 + off, hip_y + 0.05 + off)
                foot = (knee[0] + 0.08, -0.12 + off * 0.5)
                sk[f"leg{s}"] = (hip, knee, foot)
        else:
            hip_y = b.hip_y - lift
            sk["hip_y"] = hip_y
            for s in (-1, 1):
                hip = (s * b.hip_x, hip_y)
                if pose.legs == "stand":
                    spec = ("ang", 3, 0)
                elif pose.legs == "wide":
                    spec = ("ang", 11, 0)
                else:  # jump: knees out, feet tucked a little
                    spec = ("ang", 34, -42)
                knee, foot = _limb_chain(hip, spec, b.thigh, b.shin, s)
                sk[f"leg{s}"] = (hip, knee, foot)
        dy = sk["hip_y"] - b.hip_y   # everything above the hips moves with them
        sk["dy"] = dy
        sk["neck"] = (0.0, b.neck_y + dy)
        sk["head"] = (0.0, b.head_y + dy)
        for s, spec in ((-1, pose.arm_back), (1, pose.arm_front)):
            sh = (s * b.shoulder_x, b.shoulder_y + dy + b.arm_r * 0.5)
            if spec[0] == "ik":
                tx, ty = spec[1]
                spec = ("ik", (tx, ty + dy), spec[2])
            elif spec[0] == "knee":  # ("knee", leg side, dx, dy): hand resting on a knee
                kx, ky = sk[f"leg{spec[1]}"][1]
                spec = ("ik", (kx + spec[2], ky + spec[3]), "out")
            elbow, hand = _limb_chain(sh, spec, b.upper_arm, b.fore_arm, s)
            sk[f"arm{s}"] = (sh, elbow, hand)
        return sk

    # to be provided by subclasses -------------------------------------------
    def draw_legs(self, pen, sk, pose): ...
    def draw_torso(self, pen, sk, pose): ...
    def draw_head(self, hp, pose): ...
    def draw_back_hair(self, hp, pose): ...
    def describe(self): ...
    sleeve = (0, 0, 0)
    skin = (0, 0, 0)

    def draw_arm(self, pen, sk, s, pose):
        b = self.body
        sh, el, ha = sk[f"arm{s}"]
        r = b.arm_r
        pen.shapes([(_capsule(sh, el, r * 1.05, r), self.sleeve),
                    (_capsule(el, ha, r, r * 0.9), self.sleeve)])
        self.decorate_arm(pen, sh, el, ha, r)
        side = "back" if s < 0 else "front"
        hr = r * 1.05
        if pose.point == side:
            ux, uy = ha[0] - el[0], ha[1] - el[1]
            n = math.hypot(ux, uy)
            ux, uy = ux / n, uy / n
            tip = (ha[0] + ux * hr * 2.2, ha[1] + uy * hr * 2.2)
            pen.shapes([(_capsule(ha, tip, hr * 0.35), self.skin),
                        (_ellipse(ha[0], ha[1], hr, hr, 40), self.skin)])
        else:
            pen.poly(_ellipse(ha[0], ha[1], hr, hr, 40), self.skin)
        if pose.wave_lines == side:
            for k, (da, rr) in enumerate(((-30, 2.0), (-30, 2.7))):
                base = math.degrees(math.atan2(ha[1] - el[1], ha[0] - el[0]))
                for sgn in (-1, 1):
                    a0 = math.radians(base + sgn * 55 - 22)
                    a1 = math.radians(base + sgn * 55 + 22)
                    arc = _ellipse(ha[0], ha[1], hr * rr, hr * rr, 10, a0, a1)
                    pen.line(arc, OUTLINE, width_units=r * 0.22)

    def decorate_arm(self, pen, sh, el, ha, r):
        pass

    def draw_prop(self, pen, sk, pose, shot):
        if pose.legs != "sit":
            return
        b = self.body
        seat = sk["hip_y"] + b.leg_r + 0.05
        x0 = -b.hip_x - 1.4
        x1 = sk["leg1"][1][0] - 0.1
        top = (196, 140, 86)
        side = (160, 108, 64)
        pen.poly([(x0 + 0.3, seat - 0.35), (x1 + 0.3, seat - 0.35), (x1, seat), (x0, seat)], _mix(top, (255, 255, 255), 0.2))
        pen.poly([(x0, seat), (x1, seat), (x1, seat + 0.18), (x0, seat + 0.18)], top)
        for x in (x0 + 0.25, x1 - 0.25):
            pen.poly([(x - 0.11, seat + 0.18), (x + 0.11, seat + 0.18), (x + 0.11, 0), (x - 0.11, 0)], side)

    def draw(self, pen: Pen, shot: Shot):
        pose = shot.pose
        sk = self.skeleton(pose)
        b = self.body
        self.draw_prop(pen, sk, pose, shot)
        hp = pen.sub(sk["neck"][0], sk["neck"][1], rot_deg=pose.tilt)
        hp = hp.sub(0.0, b.head_y - b.neck_y, scale=b.head_r)
        self.draw_back_hair(hp, pose)
        if pose.legs == "sit":   # thighs come towards the viewer, over the torso
            self.draw_torso(pen, sk, pose)
            self.draw_legs(pen, sk, pose)
        else:
            self.draw_legs(pen, sk, pose)
            self.draw_torso(pen, sk, pose)
        # neck
        nk = sk["neck"]
        pen.poly(_rounded_rect(nk[0] - b.head_r * 0.28, nk[1] - b.head_r * 0.6,
                               nk[0] + b.head_r * 0.28, nk[1] + b.head_r * 0.4, b.head_r * 0.1), self.skin)
        self.draw_neckwear(pen, sk, pose)
        self.draw_head(hp, pose)
        for s in (-1, 1):
            self.draw_arm(pen, sk, s, pose)

    def draw_neckwear(self, pen, sk, pose):
        pass


def _face_eye(hp, x, y, rx, ry, wink=False):
    if wink:
        hp.line(_ellipse(x, y + ry * 0.3, rx * 1.3, ry * 0.7, 12, math.radians(200), math.radians(340)),
                OUTLINE, width_units=0.055)
        return
    hp.fill(_ellipse(x, y, rx, ry, 36), OUTLINE)
    hp.fill(_ellipse(x + rx * 0.3, y - ry * 0.35, rx * 0.38, rx * 0.38, 20), (255, 255, 255))


def _mouth(hp, x, y, kind, w=0.26):
    if kind == "laugh":
        pts = [(x - w, y - 0.02)] + _ellipse(x, y - 0.02, w, w * 0.95, 24, 0, math.pi)[1:-1] + [(x + w, y - 0.02)]
        hp.poly(pts, (150, 40, 50), width=hp.line_px * 1.2)
        hp.fill(_ellipse(x, y + w * 0.6, w * 0.55, w * 0.3, 24), (235, 110, 120))
    elif kind == "surprised":
        hp.poly(_ellipse(x, y + 0.04, w * 0.38, w * 0.5, 30), (150, 40, 50), width=hp.line_px * 1.2)
    elif kind == "calm":
        hp.line(_ellipse(x, y - 0.1, w * 0.6, 0.12, 12, math.radians(40), math.radians(140)), OUTLINE, width_units=0.05)
    else:  # smile / wink
        hp.line(_ellipse(x, y - 0.12, w, 0.2, 16, math.radians(25), math.radians(155)), OUTLINE, width_units=0.055)


# ---------------------------------------------------------------- Loranne

class Loranne(Character):
    trigger = "loranne"
    skin = (250, 212, 182)
    hair = (22, 168, 160)
    hair_light = (90, 206, 196)
    glasses = (250, 200, 20)
    scarf = (214, 40, 57)
    scarf_dark = (168, 24, 44)
    coat = (112, 64, 160)
    coat_dark = (84, 44, 126)
    sleeve = coat
    legging = (66, 60, 80)
    boot = (140, 88, 44)

    body = Body(height=9.0, head_y=-7.55, head_r=1.1, neck_y=-6.55, shoulder_y=-6.2, shoulder_x=0.82,
                hip_y=-3.6, hip_x=0.42, thigh=1.75, shin=1.75, upper_arm=1.35, fore_arm=1.25,
                arm_r=0.24, leg_r=0.25)

    def describe(self):
        return "a cartoon woman with a teal bob haircut, round yellow glasses, a red scarf and a purple coat"

    def draw_legs(self, pen, sk, pose):
        b = self.body
        for s in (-1, 1):
            hip, knee, foot = sk[f"leg{s}"]
            r = b.leg_r
            pen.shapes([(_capsule(hip, knee, r), self.legging), (_capsule(knee, foot, r, r * 0.85), self.legging)])
            # boot: lower 55% of the shin plus the foot
            bt = (_lerp(knee[0], foot[0], 0.4), _lerp(knee[1], foot[1], 0.4))
            toe = (foot[0] + 0.28, foot[1] + 0.02)
            pen.shapes([(_capsule(bt, foot, r * 1.12, r * 1.05), self.boot),
                        (_ellipse(toe[0], toe[1] - 0.02, 0.34, 0.2, 40), self.boot)])
            pen.fill(_capsule((bt[0] - r * 0.9, bt[1]), (bt[0] + r * 0.9, bt[1]), 0.06), _mix(self.boot, (0, 0, 0), 0.25))
        if pose.legs == "sit":  # the coat falls over her lap
            hy, kx = sk["hip_y"], sk["leg1"][1][0]
            pen.poly(_rounded_rect(-1.25, hy - 0.6, kx - 0.3, hy + 0.36, 0.3), self.coat)
            pen.line([(0.12, hy - 0.55), (0.3, hy + 0.33)], OUTLINE, width_units=0.045)

    def draw_torso(self, pen, sk, pose):
        b = self.body
        dy = sk["dy"]
        sy = b.shoulder_y + dy
        knees_y = min(sk["leg-1"][1][1], sk["leg1"][1][1])
        hem = min(sk["hip_y"] + 1.25, knees_y + 0.2)
        spread = 1.0 + (0.15 if pose.legs in ("wide", "jump", "sit") else 0.0)
        pts = ([(-1.28 * spread, hem), (-0.98, sy + 0.55)] +
               _ellipse(-0.72, sy + 0.3, 0.3, 0.3, 8, math.pi, 1.5 * math.pi)[1:] +
               _ellipse(0.72, sy + 0.3, 0.3, 0.3, 8, 1.5 * math.pi, 2 * math.pi)[:-1] +
               [(0.98, sy + 0.55), (1.28 * spread, hem)])
        pen.poly(pts, self.coat)
        # belt
        wy = sk["hip_y"] - 0.55
        wx = 0.98 + (1.28 * spread - 0.98) * ((wy - (sy + 0.55)) / (hem - sy - 0.55))
        pen.fill([(-wx, wy - 0.16), (wx, wy - 0.16), (wx + 0.01, wy + 0.16), (-wx - 0.01, wy + 0.16)], self.coat_dark)
        # front opening + buttons
        pen.line([(0.12, sy + 0.35), (0.12, wy - 0.16)], OUTLINE, width_units=0.045)
        pen.line([(0.12, wy + 0.16), (0.2, hem)], OUTLINE, width_units=0.045)
        for k in range(3):
            y = sy + 0.75 + k * (wy - sy - 0.95) / 2.5
            pen.poly(_ellipse(0.3, y, 0.08, 0.08, 20), (250, 200, 70), width=pen.line_px)
        pen.poly(_rounded_rect(-0.06, wy - 0.13, 0.3, wy + 0.13, 0.05), (250, 200, 70), width=pen.line_px)
        # pockets
        for s in (-1, 1):
            px = s * 0.68
            pen.line([(px - 0.28, wy + 0.55), (px + 0.28, wy + 0.55)], OUTLINE, width_units=0.045)

    def draw_neckwear(self, pen, sk, pose):
        b = self.body
        nx, ny = sk["neck"]
        ny += 0.28
        # hanging tail (front side) drawn first, then the wrap over it
        tail = [(nx + 0.18, ny), (nx + 0.62, ny), (nx + 0.72, ny + 1.7), (nx + 0.3, ny + 1.75)]
        pen.poly(tail, self.scarf)
        pen.fill([(nx + 0.26, ny + 1.15), (nx + 0.69, ny + 1.12), (nx + 0.7, ny + 1.3), (nx + 0.28, ny + 1.33)], self.scarf_dark)
        for k in range(4):
            t = (k + 0.5) / 4
            x0 = _lerp(nx + 0.3, nx + 0.72, t)
            pen.line([(x0, ny + 1.73 - 0.02 * t), (x0 + 0.02, ny + 1.92)], self.scarf, width_units=0.07)
        wrap = _rounded_rect(nx - 0.72, ny - 0.3, nx + 0.72, ny + 0.3, 0.26)
        pen.poly(wrap, self.scarf)
        pen.line([(nx - 0.55, ny - 0.02), (nx + 0.5, ny + 0.04)], self.scarf_dark, width_units=0.06)

    def draw_back_hair(self, hp, pose):
        fx = 0.14
        pts = (_ellipse(fx * 0.3, -0.1, 1.2, 1.12, 40, math.pi, 2 * math.pi) +
               [(1.24 + fx * 0.3, 0.55)] +
               _ellipse(0.98 + fx * 0.3, 0.62, 0.24, 0.2, 6, 0, math.pi / 2)[1:] +
               [(-0.98 + fx * 0.3, 0.82)] +
               _ellipse(-0.98 + fx * 0.3, 0.62, 0.24, 0.2, 6, math.pi / 2, math.pi)[1:] +
               [(-1.24 + fx * 0.3, 0.55)])
        hp.poly(pts, self.hair)

    def draw_head(self, hp, pose):
        fx = 0.14  # features shifted towards the facing side (3/4 view)
        hp.poly(_ellipse(0.0, 0.0, 0.95, 1.0, 64), self.skin)
        # blush
        for s in (-1, 1):
            hp.fill(_ellipse(fx + s * 0.52, 0.38, 0.16, 0.09, 24), (244, 160, 160))
        # eyes + glasses
        for s in (-1, 1):
            ex = fx + s * 0.36
            _face_eye(hp, ex, 0.08, 0.085, 0.12, wink=(pose.face == "wink" and s < 0))
        for s in (-1, 1):
            ex = fx + s * 0.36
            ring = _ellipse(ex, 0.08, 0.27, 0.27, 48)
            hp.line(ring + [ring[0]], OUTLINE, width_units=0.13, caps=False)
            hp.line(ring + [ring[0]], self.glasses, width_units=0.075, caps=False)
        hp.line([(fx - 0.09, 0.02), (fx + 0.09, 0.02)], OUTLINE, width_units=0.1)
        hp.line([(fx - 0.09, 0.02), (fx + 0.09, 0.02)], self.glasses, width_units=0.05)
        # nose
        hp.line(_ellipse(fx + 0.06, 0.33, 0.07, 0.06, 8, math.radians(-60), math.radians(120)), OUTLINE, width_units=0.045)
        _mouth(hp, fx + 0.02, 0.62, pose.face, 0.2)
        # front hair: cap + side locks with a window for the face
        wl, wr, fy = -0.72 + fx * 0.6, 0.76 + fx * 0.6, -0.32
        outer = _ellipse(fx * 0.3, -0.1, 1.2, 1.12, 40, math.pi, 2 * math.pi)
        pts = ([(-1.24 + fx * 0.3, 0.55), (-1.12 + fx * 0.3, 0.8)] + [(wl - 0.02, 0.8), (wl, fy + 0.1)] +
               _ellipse(wl + 0.1, fy, 0.1, 0.1, 6, math.pi, 1.5 * math.pi)[1:-1] +
               [(wl + 0.1, fy - 0.1), (wl + 0.45, fy - 0.06), (wl + 0.8, fy - 0.12), (wr - 0.1, fy - 0.08)] +
               _ellipse(wr - 0.1, fy + 0.02, 0.1, 0.1, 6, 1.5 * math.pi, 2 * math.pi)[1:-1] +
               [(wr, fy + 0.1), (wr + 0.02, 0.8), (1.12 + fx * 0.3, 0.8), (1.24 + fx * 0.3, 0.55)] +
               outer[::-1])  # right side, over the top, back to the left side
        hp.poly(pts, self.hair)
        # highlight
        hp.line(_ellipse(fx * 0.3, -0.1, 0.95, 0.88, 14, math.radians(215), math.radians(255)),
                self.hair_light, width_units=0.09)
        # eyebrows peeking under the fringe are hidden; small ones above the glasses
        for s in (-1, 1):
            ex = fx + s * 0.36
            lift = 0.05 if pose.face == "surprised" else 0.0
            hp.line([(ex - 0.12, -0.25 - lift), (ex + 0.12, -0.27 - lift)], _mix(self.hair, (0, 0, 0), 0.45), width_units=0.05)


# ---------------------------------------------------------------- Rolwayne

class Rolwayne(Character):
    trigger = "rolwayne"
    skin = (236, 190, 150)
    beard = (232, 114, 28)
    beard_dark = (186, 78, 16)
    hat = (44, 140, 70)
    hat_dark = (28, 100, 48)
    stripe_a = (40, 92, 170)
    stripe_b = (246, 246, 250)
    sleeve = stripe_b
    trousers = (112, 76, 44)
    shoe = (40, 36, 40)

    body = Body(height=12.7, head_y=-10.35, head_r=0.92, neck_y=-9.35, shoulder_y=-9.0, shoulder_x=1.08,
                hip_y=-5.3, hip_x=0.5, thigh=2.55, shin=2.55, upper_arm=1.85, fore_arm=1.7,
                arm_r=0.27, leg_r=0.3)

    def describe(self):
        return ("a tall cartoon man with a bushy orange beard, a green top hat "
                "and a blue and white striped shirt")

    def draw_legs(self, pen, sk, pose):
        b = self.body
        hy = sk["hip_y"]
        # hip block so the trouser tops join
        block = _rounded_rect(-b.hip_x - b.leg_r * 1.1, hy - 0.35, b.hip_x + b.leg_r * 1.1, hy + 0.45, 0.2)
        if pose.legs == "sit":
            pen.poly(block, self.trousers)
        for s in (-1, 1):
            hip, knee, foot = sk[f"leg{s}"]
            r = b.leg_r
            pen.shapes([(_capsule(hip, knee, r * 1.1, r), self.trousers), (_capsule(knee, foot, r, r * 0.95), self.trousers)])
            toe = (foot[0] + 0.3, foot[1] + 0.04)
            pen.poly(_ellipse(toe[0], toe[1] - 0.02, 0.42, 0.2, 40), self.shoe)
        if pose.legs != "sit":
            pen.poly(block, self.trousers)

    def draw_torso(self, pen, sk, pose):
        b = self.body
        dy = sk["dy"]
        sy = b.shoulder_y + dy
        wy = sk["hip_y"] - 0.1
        top_w, bot_w = 1.12, 0.9

        def half_w(y):
            return _lerp(top_w, bot_w, (y - sy) / (wy - sy))

        outline = ([(-bot_w, wy)] + _ellipse(-top_w + 0.3, sy + 0.3, 0.3, 0.3, 8, math.pi, 1.5 * math.pi) +
                   _ellipse(top_w - 0.3, sy + 0.3, 0.3, 0.3, 8, 1.5 * math.pi, 2 * math.pi) + [(bot_w, wy)])
        pen.poly(outline, self.stripe_b)
        y = sy + 0.3
        band = 0.3
        while y < wy - 0.05:
            y1 = min(y + band * 0.5, wy)
            pen.fill([(-half_w(y), y), (half_w(y), y), (half_w(y1), y1), (-half_w(y1), y1)], self.stripe_a)
            y += band
        # collar
        pen.poly([(-0.45, sy - 0.05), (0.0, sy + 0.4), (-0.05, sy + 0.55), (-0.55, sy + 0.15)], self.stripe_b)
        pen.poly([(0.45, sy - 0.05), (0.0, sy + 0.4), (0.05, sy + 0.55), (0.55, sy + 0.15)], self.stripe_b)
        # belt
        pen.poly(_rounded_rect(-bot_w - 0.04, wy - 0.08, bot_w + 0.04, wy + 0.22, 0.05), (50, 40, 36))
        pen.poly(_rounded_rect(-0.18, wy - 0.1, 0.18, wy + 0.24, 0.04), (230, 190, 70), width=pen.line_px)

    def decorate_arm(self, pen, sh, el, ha, r):
        # blue bands across the sleeve, cuff at the wrist
        for p, q, ra in ((sh, el, r), (el, ha, r)):
            ux, uy = q[0] - p[0], q[1] - p[1]
            n = math.hypot(ux, uy)
            ux, uy = ux / n, uy / n
            vx, vy = -uy, ux
            t = 0.3
            while t < n - 0.18:
                t1 = min(t + 0.15, n - 0.15)
                rr = ra * 0.97
                pen.fill([(p[0] + ux * t + vx * rr, p[1] + uy * t + vy * rr),
                          (p[0] + ux * t1 + vx * rr, p[1] + uy * t1 + vy * rr),
                          (p[0] + ux * t1 - vx * rr, p[1] + uy * t1 - vy * rr),
                          (p[0] + ux * t - vx * rr, p[1] + uy * t - vy * rr)], self.stripe_a)
                t += 0.3

    def draw_head(self, hp, pose):
        fx = 0.13
        # ears
        for s in (-1, 1):
            hp.poly(_ellipse(s * 0.86 + fx * 0.2, 0.05, 0.16, 0.24, 24), self.skin)
        hp.poly(_ellipse(0.0, 0.0, 0.86, 1.0, 64), self.skin)
        # beard (covers jaw and cheeks)
        bt = 0.18
        beard = (_ellipse(fx * 0.4, bt, 0.9, 1.2, 40, 0, math.pi) +
                 [(-0.88 + fx * 0.4, bt - 0.2), (-0.7 + fx * 0.4, bt - 0.08), (fx, bt + 0.12), (0.7 + fx * 0.4, bt - 0.08),
                  (0.9 + fx * 0.4, bt - 0.2)])
        hp.poly(beard, self.beard)
        for (cx, cy) in ((-0.4, 0.75), (0.0, 1.0), (0.45, 0.72), (-0.15, 0.55), (0.35, 1.05)):
            hp.line(_ellipse(cx + fx * 0.4, cy, 0.14, 0.1, 10, math.radians(20), math.radians(160)), self.beard_dark, width_units=0.05)
        # mouth in the beard
        _mouth(hp, fx + 0.02, 0.55, pose.face, 0.2)
        # moustache
        for s in (-1, 1):
            pts = _ellipse(fx + s * 0.2, 0.34, 0.24, 0.11, 24)
            hp.poly(pts, self.beard)
        hp.poly(_ellipse(fx + 0.47, 0.3, 0.07, 0.07, 12), self.beard)
        hp.poly(_ellipse(fx - 0.47, 0.3, 0.07, 0.07, 12), self.beard)
        # nose
        hp.poly(_ellipse(fx * 1.3, 0.16, 0.17, 0.15, 32), (228, 160, 130))
        # eyes + bushy brows
        for s in (-1, 1):
            ex = fx + s * 0.3
            _face_eye(hp, ex, -0.1, 0.075, 0.1, wink=(pose.face == "wink" and s < 0))
            lift = 0.07 if pose.face == "surprised" else 0.0
            hp.poly(_capsule((ex - s * 0.14, -0.3 - lift), (ex + s * 0.14, -0.35 - lift), 0.06), self.beard)
        # sideburn hair under the hat
        for s in (-1, 1):
            hp.poly(_rounded_rect(s * 0.78 - 0.1 + fx * 0.1, -0.62, s * 0.78 + 0.1 + fx * 0.1, 0.0, 0.08), self.beard)
        # top hat
        hp.poly(_ellipse(fx * 0.2, -0.62, 1.15, 0.22, 48), self.hat)
        crown = [(-0.7, -0.62), (-0.76, -2.2), (0.76, -2.2), (0.7, -0.62)]
        crown = [(x + fx * 0.2, y) for x, y in crown]
        hp.poly(crown + _ellipse(fx * 0.2, -0.62, 0.7, 0.12, 16, 0, math.pi)[1:-1], self.hat)
        hp.poly(_ellipse(fx * 0.2, -2.2, 0.76, 0.13, 40), self.hat_dark)
        band = [(-0.71 + fx * 0.2, -0.66), (-0.72 + fx * 0.2, -0.9), (0.72 + fx * 0.2, -0.9), (0.71 + fx * 0.2, -0.66)]
        hp.poly(band, self.stripe_a, width=hp.line_px)
        hp.line([(-0.45 + fx * 0.2, -1.2), (-0.5 + fx * 0.2, -2.0)], (110, 200, 130), width_units=0.07)

    def draw_back_hair(self, hp, pose):
        pass


CHARACTERS = {"loranne": Loranne(), "rolwayne": Rolwayne()}


# --------------------------------------------------------------------------
# shot lists
# --------------------------------------------------------------------------

def _shots_loranne():
    P = Pose
    return [
        Shot(P(arm_front=("ang", 140, 25), face="smile", wave_lines="front"), "full", "beach", 1, -0.06,
             "waving with one hand"),
        Shot(P(arm_back=("ik", (-0.95, -4.05), "out"), arm_front=("ik", (0.95, -4.05), "out"), tilt=-6, face="smile"),
             "half", "city", -1, 0.05, "standing with her hands on her hips"),
        Shot(P(tilt=9, face="smile"), "close", "studio_cream", 1, 0.0, "smiling with her head tilted"),
        Shot(P(arm_back=("ang", 150, 15), arm_front=("ang", 150, 15), legs="jump", face="laugh"), "full", "meadow", 1, 0.0,
             "jumping with both arms in the air"),
        Shot(P(arm_back=("ang", 16, -8), arm_front=("knee", 1, 0.0, -0.2), legs="sit", face="calm", tilt=4),
             "full", "room", -1, 0.05, "sitting on a wooden bench with a hand on her knee"),
        Shot(P(arm_front=("ang", 92, -8), point="front", face="surprised"), "half", "night", 1, -0.1,
             "pointing to the side with a surprised face"),
        Shot(P(legs="wide", face="smile", tilt=-4), "full", "grad_sunset", -1, 0.0, "standing relaxed with her arms down"),
        Shot(P(face="wink", tilt=-8), "close", "grad_mint", -1, 0.03, "winking"),
        Shot(P(arm_back=("ang", 135, 30), wave_lines="back", legs="wide", face="laugh"), "full", "snow", -1, 0.06,
             "waving and laughing"),
        Shot(P(arm_back=("ik", (-0.14, -4.45), "out"), arm_front=("ik", (0.14, -4.45), "out"), face="calm", tilt=5), "half",
             "studio_blue", 1, 0.0, "holding her hands together in front of her"),
    ]


def _shots_rolwayne():
    P = Pose
    b = Rolwayne.body
    hat_tip = (0.75, b.head_y - b.head_r * 1.15)
    return [
        Shot(P(arm_front=("ik", hat_tip, "out"), face="smile"), "full", "city", 1, 0.0, "tipping his hat"),
        Shot(P(arm_back=("ik", (-1.15, -5.7), "out"), arm_front=("ik", (1.15, -5.7), "out"), legs="wide", face="laugh"),
             "full", "meadow", -1, 0.05, "standing with his hands on his hips and laughing"),
        Shot(P(face="smile", tilt=-7), "close", "studio_grey", 1, 0.0, "smiling with his head tilted"),
        Shot(P(arm_back=("ang", 155, 10), arm_front=("ang", 155, 10), legs="jump", face="laugh"), "full", "beach", -1, 0.0,
             "jumping with both arms raised"),
        Shot(P(arm_front=("ang", 140, 25), wave_lines="front", face="smile", tilt=5), "half", "night", 1, -0.05,
             "waving"),
        Shot(P(arm_back=("ang", 16, -8), arm_front=("knee", 1, 0.0, -0.25), legs="sit", face="calm"), "full",
             "room", 1, 0.0, "sitting on a wooden bench with a hand on his knee"),
        Shot(P(arm_back=("ang", 90, -5), point="back", face="surprised"), "half", "grad_lilac", 1, 0.08,
             "pointing to the side with a surprised look"),
        Shot(P(face="wink", tilt=6), "close", "studio_pink", -1, 0.0, "winking"),
        Shot(P(legs="wide", face="calm"), "full", "snow", -1, -0.05, "standing with his arms at his sides"),
        Shot(P(arm_back=("ang", 60, 60), arm_front=("ang", 120, 35), wave_lines="front", legs="wide", face="laugh", tilt=-5),
             "half", "beach", -1, 0.0, "waving cheerfully"),
    ]


SHOTS = {"loranne": _shots_loranne, "rolwayne": _shots_rolwayne}

FRAMING_TEXT = {"full": "full body", "half": "half body shot", "close": "close-up portrait"}


# --------------------------------------------------------------------------
# rendering
# --------------------------------------------------------------------------

def _place(char: Character, shot: Shot):
    """Return (scale px/unit, origin x, origin y, horizon y) for the framing."""
    b = char.body
    xc = S * (0.5 + shot.x_shift)
    if shot.framing == "full":
        scale = S * 0.8 / b.height
        oy = S * 0.91
        horizon = S * 0.66
    elif shot.framing == "half":
        top = -b.height
        span = (b.hip_y - 0.3) - top
        scale = S * 0.95 / span
        oy = S * 0.07 - top * scale
        horizon = S * 0.7
    else:  # close: from the top of the head (or hat) down to the chest
        top = -b.height
        bottom = b.shoulder_y + 1.3
        scale = S * 0.95 / (bottom - top)
        oy = S * 0.06 - top * scale
        horizon = S * 0.68
    return scale, xc, oy, horizon


def render(char_name: str, index: int) -> tuple[Image.Image, str]:
    char = CHARACTERS[char_name]
    shot = SHOTS[char_name]()[index]
    seed = (1000 if char_name == "loranne" else 2000) + index
    rng = random.Random(seed)

    img = Image.new("RGB", (S, S), (255, 255, 255))
    d = ImageDraw.Draw(img)
    scale, ox, oy, horizon = _place(char, shot)
    bg_text = BACKGROUNDS[shot.background](img, d, horizon, rng)
    d = ImageDraw.Draw(img)

    line_px = min(max(scale * 0.028, 3.0), 7.0)
    pen = Pen(d, line_px=line_px).sub(ox, oy, scale=scale, mirror=(shot.facing < 0))

    if shot.framing == "full":
        sk = char.skeleton(shot.pose)
        # soft contact shadow
        shadow = Image.new("L", (S, S), 0)
        sd = ImageDraw.Draw(shadow)
        w = (char.body.hip_x + 1.5) * scale
        h = 0.35 * scale * (0.7 if sk["lift"] > 0 else 1.0)
        sd.ellipse((ox - w, oy - h, ox + w, oy + h), fill=70)
        img.paste((0, 0, 0), (0, 0), shadow)
        d = ImageDraw.Draw(img)
        pen = Pen(d, line_px=line_px).sub(ox, oy, scale=scale, mirror=(shot.facing < 0))

    char.draw(pen, shot)

    out = img.resize((FINAL, FINAL), Image.LANCZOS)
    facing = "facing right" if shot.facing > 0 else "facing left"
    caption = f"{char.trigger}, {char.describe()}, {shot.pose_text}, {facing}, {FRAMING_TEXT[shot.framing]}, {bg_text}"
    return out, caption


def all_stems():
    stems = []
    for name in CHARACTERS:
        for i in range(len(SHOTS[name]())):
            stems.append((name, i, f"{name}_{i + 1:02d}"))
    return stems


def generate(out_dir: Path, only: set[str] | None = None, verbose=True) -> list[Path]:
    written = []
    for name, i, stem in all_stems():
        if only and stem not in only:
            continue
        t0 = time.time()
        img, caption = render(name, i)
        sub = out_dir / name
        sub.mkdir(parents=True, exist_ok=True)
        jp = sub / f"{stem}.jpg"
        img.save(jp, "JPEG", quality=JPEG_QUALITY, optimize=True)
        tp = sub / f"{stem}.txt"
        tp.write_bytes((caption + "\n").encode("utf-8"))
        written += [jp, tp]
        if verbose:
            print(f"{jp.relative_to(out_dir)}  {jp.stat().st_size / 1024:.0f} KiB  {time.time() - t0:.2f}s")
    return written


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def check(ref_dir: Path, only: set[str] | None) -> int:
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        files = generate(tmp, only, verbose=False)
        for f in files:
            rel = f.relative_to(tmp)
            ref = ref_dir / rel
            if not ref.exists():
                print(f"MISSING  {rel}")
                bad += 1
            elif _sha(ref) != _sha(f):
                msg = f"MISMATCH {rel}"
                if f.suffix == ".jpg":
                    try:
                        a = np.asarray(Image.open(ref).convert("RGB"), np.int16)
                        b = np.asarray(Image.open(f).convert("RGB"), np.int16)
                        if a.shape == b.shape:
                            msg += f" (mean abs pixel diff {np.abs(a - b).mean():.3f})"
                        else:
                            msg += f" (size {a.shape[1]}x{a.shape[0]} vs {b.shape[1]}x{b.shape[0]})"
                    except Exception as e:  # unreadable reference file
                        msg += f" ({e.__class__.__name__})"
                print(msg)
                bad += 1
        if not only:
            produced = {f.relative_to(tmp) for f in files}
            for name in CHARACTERS:
                for p in sorted((ref_dir / name).glob("*")):
                    if p.relative_to(ref_dir) not in produced:
                        print(f"EXTRA    {p.relative_to(ref_dir)}")
                        bad += 1
        n = len(files)
    print(f"checked {n} files against {ref_dir}: {'OK' if not bad else f'{bad} problem(s)'}")
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help="dataset root (default: demo_datasets/ in the repository)")
    ap.add_argument("--check", action="store_true",
                    help="regenerate into a temp dir and compare sha256 with the files in --out; exit 1 on mismatch")
    ap.add_argument("--only", default="",
                    help="comma-separated stems to generate/check, e.g. loranne_01,rolwayne_02")
    args = ap.parse_args(argv)

    only = {s.strip() for s in args.only.split(",") if s.strip()} or None
    if only:
        known = {stem for _, _, stem in all_stems()}
        unknown = sorted(only - known)
        if unknown:
            ap.error(f"unknown stem(s): {', '.join(unknown)}")
    if args.check:
        return check(args.out, only)
    t0 = time.time()
    files = generate(args.out, only)
    jpgs = [f for f in files if f.suffix == ".jpg"]
    total = sum(f.stat().st_size for f in jpgs)
    print(f"wrote {len(jpgs)} images ({total / 1e6:.2f} MB) to {args.out} in {time.time() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
