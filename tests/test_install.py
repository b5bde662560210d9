"""What `make` installs: the constraints file it installs with agrees with pyproject.toml."""

from __future__ import annotations

import re

import pytest
import tomllib

from tests.conftest import REPO

packaging = pytest.importorskip("packaging.requirements")


def constraints() -> dict[str, str]:
    """requirements/constraints.txt as {normalised name: version}."""
    pins = {}
    for number, line in enumerate((REPO / "requirements" / "constraints.txt").read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        found = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)", line.strip())
        assert found, f"requirements/constraints.txt:{number}: not NAME==VERSION: {line!r}"
        pins[normalised(found.group(1))] = found.group(2)
    return pins


def normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_constraints_pin_only_versions_pyproject_allows_and_every_direct_dependency():
    # Wrong if `make test` installed a version of a dependency that pyproject.toml rules out (a range
    # raised without refreshing the constraints: the install would fail, or the suite would test a
    # set no user gets), or if a dependency of hpref or of an extra `make` installs were left
    # unpinned (a release of it could fail a clean clone's CI while this tree passes).
    from packaging.requirements import Requirement
    from packaging.version import Version

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    makefile = (REPO / "Makefile").read_text()
    extras = re.search(r"-e '\.\[([a-z0-9,-]+)\]'", makefile)
    assert extras, "the Makefile's install of hpref's extras was not found"
    wanted = list(project["dependencies"])
    for extra in extras.group(1).split(","):
        wanted += project["optional-dependencies"][extra]
    pins = constraints()
    # torch: requirements/cpu-torch.txt pins the CPU build; the Makefile pins what it installs after
    installed_after = re.findall(r"(?:--no-deps|install -q) ([a-z0-9-]+)==", makefile)
    own_pins = {"torch"} | {normalised(n) for n in installed_after}
    for text in wanted:
        requirement = Requirement(text)
        name = normalised(requirement.name)
        if name in own_pins or (requirement.marker and not requirement.marker.evaluate()):
            continue
        assert name in pins, f"{text}: not pinned in requirements/constraints.txt"
        assert requirement.specifier.contains(Version(pins[name]), prereleases=True), (
            f"requirements/constraints.txt pins {name}=={pins[name]}, "
            f"which pyproject.toml's {text!r} rules out"
        )
    assert "torch" not in pins, "torch is requirements/cpu-torch.txt's to pin (the CPU build)"
