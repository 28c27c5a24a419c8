"""What the docs point at is there and current: every path of this repository that the README, the
docs, tests/README, the scripts and the requirements name exists (tests moved between tiers left old
paths behind), and a screenshot of a bundled workflow in the docs shows that workflow as it is now (the
browser test records the workflow file's hash in the PNG it takes: tests/server/test_frontend.py)."""
import hashlib
import re
from pathlib import Path

import pytest
from PIL import Image

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", REPO / "tests" / "README.md", *sorted((REPO / "docs").glob("*.md")),
        *sorted((REPO / "scripts").glob("*.sh")), REPO / "requirements-dev.txt", REPO / "requirements.txt",
        REPO / "pyproject.toml"]
PATH = re.compile(r"(?<![\w./-])((?:tests|docs|scripts|example_workflows|demo_datasets|bench|ugpum|nodes)/"
                  r"[\w./-]*\w)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_repository_path_a_doc_names_exists(doc):
    named = {m for m in PATH.findall(doc.read_text()) if "*" not in m and "NAME" not in m and "<" not in m}
    gone = sorted(p for p in named if not (REPO / p).exists() and not (REPO / p.rstrip(".")).exists())
    assert not gone, f"{doc.relative_to(REPO)} names {gone}, which are not in the repository"


def workflow_stamp(workflow: Path) -> str:
    return f"{workflow.name} sha256={hashlib.sha256(workflow.read_bytes()).hexdigest()}"


def test_the_readme_screenshot_shows_the_bundled_workflow_as_it_is():
    shots = re.findall(r"!\[[^\]]*\]\((docs/[\w.-]+\.png)\)", (REPO / "README.md").read_text())
    assert shots, "the README shows no screenshot"
    for shot in shots:
        stamp = Image.open(REPO / shot).text.get("ugpum-workflow")
        assert stamp, f"{shot} records no workflow: take it with the browser test (see below)"
        workflow = REPO / "example_workflows" / stamp.split(" ")[0]
        assert stamp == workflow_stamp(workflow), (
            f"{shot} shows an older {workflow.name}: UGPUM_SCREENSHOTS=/tmp/shots .venv/bin/python -m pytest "
            f"tests/server/test_frontend.py -k 'opens_from_templates and {workflow.stem}', then copy "
            f"/tmp/shots/workflow_{workflow.stem}.png to {shot}")
