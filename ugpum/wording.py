"""A setting named in a message, worded for whoever shows the message.

The core never words its advice as a command-line flag or a node widget: it marks the setting it means
(`setting("weight_dtype", "fp8")`), and each front end puts the marks into its own words when it shows
the message: the command line as a flag of the verb the user ran (`--dtype fp8`), the nodes as the
input on the node the user sees (`weight_dtype = fp8 on the UGPUM Loader`). `plain()` is the
setting's own name (`weight_dtype = fp8`, as a --config TOML writes it), for anything else.

The engine's own errors derive from `EngineError` (besides their builtin base), so that each front end
catches them in one place and shows their message in its words.
"""
from __future__ import annotations

import re

_MARK = re.compile(r"\{setting:(\w+)(?:=([^{}]*))?\}")
# A value may be user input (a folder named "run {1}"): its braces travel percent-encoded, so that a mark
# ends at its own closing brace, and the front end shows the value as given.
_CODES = {"%": "%25", "{": "%7B", "}": "%7D"}
_ENCODED = re.compile("|".join(map(re.escape, _CODES.values())))
_DECODED = {code: char for char, code in _CODES.items()}


class EngineError(Exception):
    """An error the engine raises on purpose: a sentence that says what went wrong and what to do, the
    settings it names marked (`setting`). Each engine error keeps its builtin base (ValueError,
    RuntimeError, OSError) as well, for callers that catch those; the front ends catch this one and word
    its message: `for_cli` on the command line, `for_nodes` on the nodes."""


def setting(name: str, value: object = None) -> str:
    """A mark for setting `name` (at `value`), to be worded by the front end that shows the message."""
    if isinstance(value, bool):
        value = str(value).lower()                     # as TOML writes it
    if value is None:
        return "{setting:" + name + "}"
    return "{setting:" + name + "=" + "".join(_CODES.get(c, c) for c in str(value)) + "}"


# name -> flag, for each verb (a setting a verb has no flag for is worded as its --config key)
_FLAGS = {
    "plan": {"weight_dtype": "--dtype", "recompute": "--recompute", "batch": "--batch",
             "resolution": "--resolution", "gpu": "--gpu", "base_compute": "--base-compute", "rank": "--rank",
             "grad_accum": "--grad-accum", "frames": "--frames", "schedule": "--schedule",
             "distributed": "--distributed", "replicas": "--replicas"},
    "train": {"batch": "--batch", "base_compute": "--base-compute", "grad_accum": "--grad-accum",
              "frames": "--frames", "schedule": "--schedule", "steps": "--steps", "compile": "--compile",
              "devices": "--devices", "dataset": "--dataset", "model_file": "--model",
              "resume": "--resume", "overwrite": "--overwrite", "distributed": "--distributed",
              "replicas": "--replicas"},
    "demo": {"steps": "--steps"},
}
# the values a flag takes where they differ from the setting's (none differ at present)
_FLAG_VALUES: dict[tuple[str, str], str] = {}
# name -> (input, node)
_NODE_INPUTS = {"weight_dtype": ("weight_dtype", "UGPUM Loader"), "devices": ("devices", "UGPUM Loader"),
                "gpu": ("devices", "UGPUM Loader"), "resolution": ("resolution", "Partition Planner"),
                "batch": ("batch", "Partition Planner"), "grad_accum": ("gradient accumulation", "Partition Planner"),
                "rank": ("LoRA rank", "Partition Planner"), "recompute": ("recompute", "Partition Planner"),
                "frames": ("frames", "Partition Planner"), "schedule": ("schedule", "Partition Planner"),
                "base_compute": ("base compute", "Partition Planner"), "replicas": ("replicas", "Partition Planner"),
                "steps": ("steps", "LoRA Trainer"),
                "compile": ("compile", "LoRA Trainer"), "dataset": ("dataset", "LoRA Trainer"),
                "model_file": ("dit_name", "UGPUM Loader")}
# What the nodes say for a setting they hold otherwise, or not at all (the same with a value or without,
# unless a pair: (without a value, with one)).
_NODE_WORDS = {
    # the trainer's Boolean input; the run folder (the value) is the save name's
    "resume": ("resume on the LoRA Trainer", "resume on the LoRA Trainer (same save name)"),
    # the trainer never replaces an earlier run
    "overwrite": "not on the LoRA Trainer, which keeps every run: give a new save name",
    # one ComfyUI process trains; a distributed run starts from the command line under torchrun
    "distributed": "the command line's distributed mode",
}


def _replace(text: str, word) -> str:
    def decoded(value):
        return None if value is None else _ENCODED.sub(lambda m: _DECODED[m.group()], value)
    return _MARK.sub(lambda m: word(m.group(1), decoded(m.group(2))), text)


def plain(text: str) -> str:
    """Marks as the settings' own names: `weight_dtype = fp8`."""
    return _replace(text, lambda name, value: name if value is None else f"{name} = {value}")


def for_cli(text: str, verb: str = "plan") -> str:
    """Marks as the flags of `verb` (`--dtype fp8`); a setting it has no flag for as its --config key."""
    flags = _FLAGS.get(verb, {})

    def word(name, value):
        flag = flags.get(name)
        if flag is None:
            key = name if value is None else f"{name} = {value}"
            return f"{key} in the --config TOML" if verb == "train" else key
        value = _FLAG_VALUES.get((name, value), value)
        return flag if value is None else f"{flag} {value}"
    return _replace(text, word)


def for_nodes(text: str) -> str:
    """Marks as the input on the node that holds it: `weight_dtype = fp8 on the UGPUM Loader`; a setting
    the nodes hold otherwise (resume), or not at all (overwrite), as what they offer instead."""
    def word(name, value):
        if name in _NODE_WORDS:
            words = _NODE_WORDS[name]
            return words if isinstance(words, str) else words[value is not None]
        field, node = _NODE_INPUTS.get(name, (name, "node"))
        value = _FLAG_VALUES.get((name, value), value)
        return f"{field} on the {node}" if value is None else f"{field} = {value} on the {node}"
    return _replace(text, word)


def quoted(value: object, limit: int = 300) -> str:
    """`value` as a message quotes it (its repr), cut to about `limit` characters with how much was left
    out: a message never repeats a 10 MB input back (a name a file may take, 255 bytes, is shown whole)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f"{len(value):,} characters" if isinstance(value, str) else f"{len(text):,} characters as written"
    return f"{text[:limit]}... ({size})"


def cut_values(text: str, values, limit: int = 300) -> str:
    """`text` with each of `values` (what the user gave: command-line arguments) longer than `limit` cut
    where it appears, as it is or as its repr shows it, the way `quoted` cuts: a message never repeats
    a 10 MB input back, whichever message quotes it."""
    for value in sorted({v for v in values if isinstance(v, str) and len(v) > limit}, key=len, reverse=True):
        cut = f"{value[:limit]}... ({len(value):,} characters)"
        for shown in dict.fromkeys((value, repr(value)[1:-1])):
            if shown in text:
                text = text.replace(shown, cut)
    return text
