"""Issue 39's parts on their own (no subprocess, no training): the sentence of each write the system
refuses, long values cut in any message, the note of a resume that changes the steps, a PNG's metadata
read wherever it sits and its transparent colour matched at its own depth."""
from __future__ import annotations

import errno
import struct

import numpy as np
import pytest
from PIL import Image

from support.png_files import chunk, exif_orientation, png
from ugpum.formats.disk_space import DiskFull, refused_write
from ugpum.formats.refused import SaveRefused
from ugpum.train.config import TrainConfig
from ugpum.train.lr_schedule import resume_note
from ugpum.train.pictures import image_size, open_rgb
from ugpum.train.png_chunks import orienting_metadata
from ugpum.wording import cut_values, plain


@pytest.mark.parametrize("code, said", [
    (errno.EFBIG, "the file would be larger than this system lets a process write"),
    (errno.EDQUOT, "this user's disk quota there is used up; free some of your files on that disk, or ask for a "
                   "larger quota"),
    (errno.EROFS, "its disk is read-only now"),
    (errno.EIO, "the disk reported an input/output error"),
], ids=["file-size-limit", "quota", "read-only", "io-error"])
def test_each_refusal_is_one_sentence_naming_the_file_the_reason_and_what_is_kept(tmp_path, code, said):
    for error in (OSError(code, "raw"), RuntimeError(f"Error while serializing: I/O error: raw (os error {code})")):
        refused = refused_write(error, tmp_path, "x.safetensors", kept="kept: the checkpoint step_000001")
        assert isinstance(refused, SaveRefused) and not isinstance(refused, DiskFull) and refused.errno == code
        text = str(refused)
        assert text.startswith(f"cannot write x.safetensors in {tmp_path}: {said}") and "Errno" not in text, text
        assert text.endswith("; kept: the checkpoint step_000001"), text


def test_other_errors_pass_as_they_are(tmp_path):
    error = OSError(errno.EACCES, "Permission denied")
    assert refused_write(error, tmp_path, "x") is error


def test_a_long_value_is_cut_wherever_a_message_repeats_it():
    value = "v" * 5000 + "'"
    text = cut_values(f"unknown {value!r}; and {value} again", [value, "short"])
    assert text.count("v" * 300 + "... (5,001 characters)") == 2 and "v" * 301 not in text, text[:700]


def test_a_resume_with_other_steps_states_both_rates_and_one_with_the_same_says_nothing():
    cosine = TrainConfig(lr_schedule="cosine", lr=1e-3, steps=6)
    assert plain(resume_note(cosine, 3, 3)) == ("learning rate: steps = 6 where the run started with 3, so its cosine "
                                                "schedule is stretched over 6 steps: step 3 trained at lr 0.00025, "
                                                "step 4 trains at lr 0.0005")
    assert resume_note(cosine, 6, 3) is None
    assert resume_note(TrainConfig(lr=1e-3, steps=6), 3, 3) is None          # constant: no change to say


def test_a_pngs_orientation_after_its_pixels_is_read_without_decoding_them(tmp_path):
    path = tmp_path / "turned.png"
    path.write_bytes(png(np.zeros((48, 64, 3), np.uint8), 8, 2, after=[chunk(b"eXIf", exif_orientation(6))]))
    assert orienting_metadata(path) == {"exif": b"Exif\x00\x00" + exif_orientation(6)}
    assert image_size(path) == open_rgb(path).size == (48, 64)


def test_a_transparent_colour_at_16_bits_is_matched_at_16_bits(tmp_path):
    path = tmp_path / "keyed.png"
    samples = np.array([[[1000, 2000, 3000], [1005, 2000, 3000]]] * 16 * 8, np.uint16).reshape(16, 16, 3)
    path.write_bytes(png(samples, 16, 2, trns=struct.pack(">HHH", 1000, 2000, 3000)))
    shown = np.asarray(open_rgb(path))
    assert (shown[:, 0::2] == 255).all() and (shown[:, 1::2] == [3, 7, 11]).all()    # (same high bytes: kept)
    with Image.open(path) as image:
        assert image.info["transparency"] == (1000, 2000, 3000)
