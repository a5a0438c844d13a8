"""The Dockerfile against the project it packages (no build here; the node tests run the images):
every package folder reaches the images, and the slim operator image's dependencies are the
project's own and all that `pdserve operator` imports."""
from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, distribution, packages_distributions
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "triton", "transformers", "numpy", "safetensors")


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _image_requirements(p: dict) -> list[str]:
    """What the Dockerfile installs: the dependencies and the `k8s` and `otel` extras (the workers export traces
    when their pods set the OpenTelemetry variables), where there are such."""
    extras = p["project"].get("optional-dependencies", {})
    return p["project"]["dependencies"] + extras.get("k8s", []) + extras.get("otel", [])


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~ \[;]", requirement)[0].lower()


def test_the_sources_stage_copies_every_package_folder():
    dockerfile = (REPO / "Dockerfile").read_text()
    stage = dockerfile.split("AS sources", 1)[1].split("\nFROM ", 1)[0]
    copied = {src for line in stage.splitlines() if line.startswith("COPY ") for src in line.split()[1:-1]}
    folders = set(_pyproject()["tool"]["setuptools"]["package-dir"].values())
    assert copied == folders | {"pyproject.toml", "README.md"}


def test_operator_image_dependencies_are_the_projects_and_cover_its_imports():
    p = _pyproject()
    names = {_name(d) for d in _image_requirements(p)}
    operator = set(p["tool"]["pdserve"]["operator-image"])
    assert operator <= names
    assert not operator & set(HEAVY)
    # What `pdserve operator` loads, in a fresh interpreter: its top-level modules.
    code = ("import sys, json; import pdserve.operator.main, pdserve.operator.handlers; "
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    loaded = set(json.loads(out.stdout))
    # ... and what its modules import inside functions (loaded only when that code runs).
    for path in (REPO / "operator").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                loaded |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                loaded.add(node.module.split(".")[0])
    # Every project requirement it loads comes with the operator image's distributions (torch is
    # kept out of the operator by test_operator_reconcile; here: what the image must hold).
    by_module = packages_distributions()
    dists = {_canonical(d) for m in loaded for d in by_module.get(m, [])}
    assert (dists & {_canonical(n) for n in names}) - _closure(operator) - {"pdserve"} == set()


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(names: set[str]) -> set[str]:
    """The distributions `names` install, with everything they require (as installed here)."""
    todo, seen = [_canonical(n) for n in names], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = distribution(name).requires or []
        except PackageNotFoundError:
            continue
        todo += [_canonical(_name(r)) for r in reqs if "extra ==" not in r]
    return seen


def test_the_requirements_stage_writes_each_images_requirements(tmp_path):
    """The Dockerfile's requirements stage, run here on the repository's pyproject.toml: the workers
    get the dependencies and the `k8s` and `otel` extras, the operator those of its distributions only."""
    dockerfile = (REPO / "Dockerfile").read_text()
    stage = dockerfile.split("AS requirements\n", 1)[1].split("\nFROM ", 1)[0]
    program = re.search(r"python -c '(.*)'$", stage, re.M).group(1)
    program = program.replace("/tmp/pyproject.toml", str(REPO / "pyproject.toml")).replace(
        "/requirements/", f"{tmp_path}/")
    subprocess.run([sys.executable, "-c", program], check=True)
    p = _pyproject()
    wanted = _image_requirements(p)
    assert (tmp_path / "workers.txt").read_text().splitlines() == wanted
    operator = set(p["tool"]["pdserve"]["operator-image"])
    got = (tmp_path / "operator.txt").read_text().splitlines()
    assert got == [d for d in wanted if _name(d) in operator] and {_name(d) for d in got} == operator
    # the dependency layers take these files, never pyproject.toml itself
    after = dockerfile.split("AS requirements\n", 1)[1].split("\nFROM ", 1)[1]
    assert "COPY pyproject.toml" not in after and "COPY --from=requirements" in after
