"""pyproject.toml read the way the Comfy Registry's parser reads it (comfy-cli,
comfy_cli/registry/config_parser.py: extract_node_configuration and validate_node_for_publishing):
[project] name, version, license ({file} / {text} / a string), the urls keys it knows (Homepage,
Documentation, Repository, Issues: any other key is dropped), the Operating System and accelerator
classifiers it accepts; [tool.comfy] PublisherId, DisplayName, Icon. Its rules are restated here, not
imported, so this runs without comfy-cli (tests/test_frontend.py runs the real `comfy node validate`)."""
import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
REPOSITORY = "https://github.com/ugpum/ComfyUI-UGPUM"
URL_KEYS_READ = {"Homepage", "Documentation", "Repository", "Issues"}
OS_PREFIXES = ("Microsoft", "POSIX", "MacOS", "OS Independent")
ACCELERATORS = {"GPU :: NVIDIA CUDA", "GPU :: AMD ROCm", "GPU :: Intel Arc", "NPU :: Huawei Ascend", "GPU :: Apple Metal"}


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


def test_project_table_is_complete():
    project = pyproject()["project"]
    assert project["name"].strip() and project["description"].strip()
    assert re.fullmatch(r"\d+\.\d+\.\d+", project["version"]), "the registry publishes major.minor.patch versions"
    licence = project["license"]
    assert isinstance(licence, dict) and set(licence) <= {"file", "text"} and licence, \
        'license = {file = "LICENSE"} or {text = ...}: another form makes the registry warn'
    text = (REPO / licence["file"]).read_text()
    assert "Apache License" in text and "Version 2.0" in text and "END OF TERMS AND CONDITIONS" in text


def test_urls_use_the_keys_the_registry_reads():
    urls = pyproject()["project"]["urls"]
    assert set(urls) <= URL_KEYS_READ, f"the registry ignores {set(urls) - URL_KEYS_READ}"
    assert urls["Repository"] == REPOSITORY and urls["Issues"] == REPOSITORY + "/issues"
    assert all(value.startswith(REPOSITORY) for value in urls.values())


def test_classifiers_are_ones_the_registry_accepts():
    classifiers = pyproject()["project"]["classifiers"]
    systems = [c.removeprefix("Operating System :: ") for c in classifiers if c.startswith("Operating System :: ")]
    accelerators = [c.removeprefix("Environment :: ") for c in classifiers if c.startswith("Environment ::")]
    assert systems and all(s.startswith(OS_PREFIXES) for s in systems), systems
    assert accelerators and set(accelerators) <= ACCELERATORS, accelerators


def test_tool_comfy_names_publisher_display_name_and_an_icon_in_the_repository():
    comfy = pyproject()["tool"]["comfy"]
    for key in ("PublisherId", "DisplayName", "Icon"):
        assert isinstance(comfy.get(key), str) and comfy[key].strip(), key
    raw = "https://raw.githubusercontent.com/ugpum/ComfyUI-UGPUM/main/"
    assert comfy["Icon"].startswith(raw) and (REPO / comfy["Icon"].removeprefix(raw)).is_file()


def test_dependencies_match_requirements_txt():
    """ComfyUI-Manager installs requirements.txt; the registry reads [project] dependencies: the same list."""
    listed = [line.strip() for line in (REPO / "requirements.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert pyproject()["project"]["dependencies"] == listed
