"""Packaging beyond pyproject.toml: what the wheel holds, and the compiled core.

What the wheel holds: every package setuptools finds (no hand list), plus the checkout's top-level data
folders shipped inside the gateway package, so an installed gateway reads them with importlib.resources
exactly as a checkout does (gateway/shipped_files.py): config/ becomes `gateway.defaults`, static/ becomes
`gateway.static`.

The compiled core: mypyc turns the scheduler's hot modules into C extensions at install, when a C compiler
and the Python headers are there. Without them (a warning), or with FANOUT_PURE_PYTHON=1 set, the same
modules run as plain Python (docs/architecture.md, "The compiled core"). Beside the extensions the build
records a digest of each source it compiled (core/_compiled.json): core/native.py runs the compiled modules
only while every source still has that digest, whatever the files' times say.

The fan-out writer (gateway/_fanwrite.c, used by gateway/fanwrite.py) is built the same way, optional too:
without it its Python twin (gateway/fanwrite_py.py) runs.
"""

import hashlib
import json
import os
import sys
import warnings
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent

# An editable install (`make setup`: pip install -e) of this layout, whose data folders are mapped into the
# gateway package, goes through setuptools' import finder, which says so in a "!!" box ("Editable
# installation. Please be careful with folders ...") that pip shows even with -q: information about the
# install, not a problem of it. Silenced; every other warning still shows.
warnings.filterwarnings("ignore", message=r"Editable installation\.", category=UserWarning)

# The modules a cycle runs through. Not compiled: config.py (it validates untyped input at run time, which
# mypyc's type checks would turn into TypeErrors), errors.py (no hot path) and byte_ring.py (the raw TCP
# path measured slower compiled, docs/architecture.md).
COMPILED = [
    "core/client.py",
    "core/counters.py",
    "core/delta.py",
    "core/engine.py",
    "core/entries.py",
    "core/fairness.py",
    "core/fossil.py",
    "core/private.py",
    "core/ring.py",
    "core/snapshot.py",
    "core/topics.py",
]
#: Written beside the compiled modules; read by core/native.py.
BUILD_RECORD = "_compiled.json"

#: Data folders of the checkout, shipped as packages of their own inside `gateway`.
DATA_PACKAGES = {"gateway.defaults": "config", "gateway.static": "static", "gateway.static.admin": "static/admin"}


def source_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class RecordingBuildExt(build_ext):
    """build_ext that also writes which sources the core's extensions were compiled from."""

    def run(self) -> None:
        super().run()
        built = {}
        for ext in self.extensions:
            package, _, name = ext.name.rpartition(".")
            if package == "core" and os.path.exists(self.get_ext_fullpath(ext.name)):
                built[name] = source_digest(HERE / "core" / f"{name}.py")
        if built:
            target = Path(self.get_ext_fullpath("core.client")).parent / BUILD_RECORD
            target.write_text(json.dumps(built, indent=1, sort_keys=True) + "\n")

    def get_outputs(self) -> list:
        # the record belongs to the build's outputs, so an editable install's wheel and a wheel both hold it
        outputs = super().get_outputs()
        if self.extensions:
            outputs.append(str(Path(self.get_ext_fullpath("core.client")).parent / BUILD_RECORD))
        return outputs


#: commands that build no extension and write nothing a build ships: the egg-info that build's and pip's first
#: hook (get_requires_for_build_*) writes; the sdist, the wheel and pip's dist_info write theirs again (its
#: top_level.txt names the mypyc module, so they run mypycify)
NO_BUILD = {"egg_info"}


def extensions() -> list:
    if os.environ.get("FANOUT_PURE_PYTHON", "") not in ("", "0"):
        return []
    from mypyc.build import mypycify

    # mypycify type-checks the core and writes its C (seconds) for a command that never compiles it: skipped
    # there; any other word in argv runs it
    commands = [arg for arg in sys.argv[1:] if arg.isidentifier()]
    modules = [] if commands and set(commands) <= NO_BUILD else mypycify(COMPILED, opt_level="3")
    # the fan-out writer (gateway/fanwrite.py): one frame to many sockets in one call
    modules.append(Extension("gateway._fanwrite", ["gateway/_fanwrite.c"], extra_compile_args=["-O2"]))
    for module in modules:
        module.optional = True  # a failed compile warns; the modules then run as Python
    return modules


setup(
    packages=find_packages(include=["core", "gateway", "gateway.*", "fanout_client", "fanout_client.*", "loadtest", "pipeline"])
    + list(DATA_PACKAGES),
    package_dir=DATA_PACKAGES,
    package_data={
        "gateway.defaults": ["*.toml"],
        "gateway.static": ["*.html", "*.js", "*.ts", "*.ico", "*.svg"],
        "gateway.static.admin": ["*.html", "*.js", "*.css"],
        "fanout_client": ["py.typed"],
        "pipeline": ["log4j2.properties"],
        "loadtest": ["*.template"],
    },
    ext_modules=extensions(),
    cmdclass={"build_ext": RecordingBuildExt},
)
