"""The README's commands run as written after its own setup step: its first code block is the two
scripts a newcomer pastes; every `ugpum VERB ...` it shows answers `ugpum VERB --help` through the
`ugpum` command scripts/setup.sh puts into .venv (run from another folder, as a user would), and every
flag the README gives a verb is one that verb takes."""
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
LAUNCHER = REPO / ".venv" / "bin" / "ugpum"


def code_blocks(text: str) -> list[str]:
    return re.findall(r"```[a-z]*\n(.*?)```", text, re.S)


def readme_commands() -> dict[str, set[str]]:
    """verb -> the flags the README's code blocks give it (continuation lines joined to their command)."""
    verbs: dict[str, set[str]] = {}
    for block in code_blocks(README):
        verb = None
        for line in block.splitlines():
            match = re.match(r"\s*(?:torchrun .*?-m |python -m )?ugpum\s+([a-z]+)", line)
            if match:
                verb = match[1]
                verbs.setdefault(verb, set())
            elif not line.startswith(" "):
                verb = None
            if verb:
                code = line.split("#", 1)[0]
                verbs[verb] |= set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", code))
    return verbs


def test_the_first_lines_are_the_two_commands_a_newcomer_pastes():
    first = code_blocks(README)[0]
    assert [line.split("#")[0].strip() for line in first.strip().splitlines()] == [
        "bash scripts/demo.sh", "bash scripts/test.sh"]
    assert README.index("```") < 40                                   # on the first screen
    for script in ("demo.sh", "test.sh", "setup.sh"):
        assert (REPO / "scripts" / script).is_file()
    assert "source .venv/bin/activate" in README and "https://github.com/ugpum/ComfyUI-UGPUM" in README


COMMANDS = readme_commands()


def test_the_readme_shows_every_verb():
    assert set(COMMANDS) == {"plan", "train", "demo", "download", "doctor", "bench"}


@pytest.mark.parametrize("verb", sorted(COMMANDS))
def test_each_verb_answers_help_with_every_flag_the_readme_gives_it(verb, tmp_path):
    assert LAUNCHER.is_file(), "run bash scripts/setup.sh: it makes the ugpum command in .venv"
    done = subprocess.run([str(LAUNCHER), verb, "--help"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: ugpum {verb}"), done.stdout[:200]
    missing = {flag for flag in COMMANDS[verb] if flag not in done.stdout}
    assert not missing, f"the README gives `ugpum {verb}` flags it does not take: {sorted(missing)}"
