"""constraints.txt, the lock both `make run` and `make setup` install with (pip -c): every package pinned `==`,
transitive ones included, so a fresh machine gets what was tested.

The venv running this test holds only what the file pins, each at its pinned version (the Makefile's sync step
uninstalls the rest), and with every extra installed, all of it; every pin of pyproject.toml (its dependencies,
every extra, [build-system]) is exact and is the file's; and the Makefile installs with the file and sets up again
when it changes."""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "constraints.txt"
PIN = re.compile(r"(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[^\s;#]+)")
#: this checkout, installed editable: the one distribution the lock does not pin
OURS = "fanout-gateway"


def locked() -> dict[str, str]:
    """constraints.txt's pins, by canonical name; a line that is neither a comment nor `name==version` fails."""
    pins: dict[str, str] = {}
    for number, line in enumerate(CONSTRAINTS.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        match = PIN.fullmatch(line.strip())
        assert match, f"constraints.txt:{number}: {line!r} is not name==version"
        name = canonicalize_name(match["name"])
        assert name not in pins, f"constraints.txt:{number}: {name} pinned twice"
        pins[name] = match["version"]
    return pins


def pyproject_requirements() -> dict[str, list[str]]:
    """pyproject.toml's requirement strings by where they are: `dependencies`, each extra, `build-system`."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = data["project"]
    return {
        "dependencies": project["dependencies"],
        **{f"[{extra}]": group for extra, group in project["optional-dependencies"].items()},
        "build-system": data["build-system"]["requires"],
    }


@pytest.mark.unit
def test_the_file_says_how_it_is_made_and_pins_every_package_once() -> None:
    head = CONSTRAINTS.read_text().split("\n\n", 1)[0]
    assert head.startswith("#") and "make lock" in head, head
    assert len(locked()) > 50


@pytest.mark.unit
def test_every_installed_distribution_is_pinned_at_its_installed_version() -> None:
    pins = locked()
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}
    unpinned = sorted(name for name in installed if name not in pins and name != OURS)
    elsewhere = sorted(
        f"{name} {version} (constraints.txt: {pins[name]})"
        for name, version in installed.items()
        if name in pins and pins[name] != version
    )
    assert not unpinned and not elsewhere, (
        f"installed but not in constraints.txt: {unpinned}; installed at another version: {elsewhere} "
        "(`make setup` installs the file's set, `make lock` writes the file again from pyproject.toml)"
    )


@pytest.mark.unit
def test_with_every_extra_installed_every_pin_is_installed_too() -> None:
    """A pin nothing needs any more (a dependency dropped from pyproject.toml without `make lock`) shows in the full
    set's venv as a pin not installed."""
    installed = {canonicalize_name(d.metadata["Name"]) for d in importlib.metadata.distributions()}
    wanted = {canonicalize_name(Requirement(text).name) for group in pyproject_requirements().values() for text in group}
    if not wanted <= installed:
        pytest.skip(f"not every extra is installed here (no {sorted(wanted - installed)[:3]}...): `make setup` installs them")
    assert sorted(set(locked()) - installed) == [], "pinned, not installed: `make lock` writes the file again"


@pytest.mark.unit
def test_every_pyproject_pin_is_exact_and_agrees_with_the_lock() -> None:
    pins = locked()
    wrong = []
    for where, requirements in pyproject_requirements().items():
        for text in requirements:
            requirement = Requirement(text)
            name = canonicalize_name(requirement.name)
            exact = [spec.version for spec in requirement.specifier if spec.operator == "=="]
            if len(exact) != 1 or len(requirement.specifier) != 1:
                wrong.append(f"{where}: {text!r} is not one exact pin")
            elif pins.get(name) != exact[0]:
                wrong.append(f"{where}: {text!r}, constraints.txt: {pins.get(name, 'no pin')}")
            if requirement.extras:  # an extra's packages would be resolved unseen by this test's reading
                wrong.append(f"{where}: {text!r} asks for extras; name each package instead")
    assert wrong == [], "\n".join(wrong)


def test_both_sets_install_with_the_lock_and_set_up_again_when_it_changes() -> None:
    if shutil.which("make") is None:
        pytest.skip("no make")
    # -n -B: the recipes as on a fresh clone, printed, not run; -p: make's rules, with their prerequisites
    printed = subprocess.run(
        ["make", "-n", "-B", "-p", "-C", str(ROOT), ".venv/.installed"], capture_output=True, text=True, timeout=60
    ).stdout.splitlines()
    installs = [line for line in printed if line.startswith(".venv/bin/pip install")]
    assert len(installs) == 4, installs  # pip and setuptools, the serving set, the gateway, the extras
    assert all("-c constraints.txt" in line for line in installs), installs
    assert any(" -e . " in line and "--build-constraint constraints.txt" in line for line in installs), installs
    for stamp in (".venv/.installed-run", ".venv/.installed"):
        rule = next(line for line in printed if line.startswith(f"{stamp}:"))
        assert "constraints.txt" in rule.split(":", 1)[1].split(), rule
