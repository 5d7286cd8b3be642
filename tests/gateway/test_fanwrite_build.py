"""Which fan-out writer runs (gateway/fanwrite.py): the compiled one wherever it can be built, so a build
that silently dropped it fails here (setup.py builds it `optional`: a failed compile only warns); its Python
twin where it is not built or FANOUT_PURE_PYTHON is set at run time; and `BUILD` says which."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from gateway import fanwrite, fanwrite_py

PURE = os.environ.get("FANOUT_PURE_PYTHON", "") not in ("", "0")

# What the gateway's import chooses, printed as JSON; argv[1] "hide" makes the compiled module unimportable.
CHOICE = """
import json, sys
if sys.argv[1:] == ["hide"]:
    sys.modules["gateway._fanwrite"] = None  # as if it were not built
from gateway import fanwrite
print(json.dumps({"build": fanwrite.BUILD, "module": fanwrite.Sender.__module__}))
"""


def _can_compile() -> bool:
    """A C compiler and the Python headers: what setup.py needs to build the writer (as the core's test)."""
    cc = (sysconfig.get_config_var("CC") or "").split()
    return bool(cc) and shutil.which(cc[0]) is not None and Path(sysconfig.get_paths()["include"], "Python.h").exists()


def _choice(pure: str, *argv: str) -> dict[str, str]:
    env = {**os.environ, "FANOUT_PURE_PYTHON": pure}
    done = subprocess.run([sys.executable, "-c", CHOICE, *argv], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    result: dict[str, str] = json.loads(done.stdout)
    return result


@pytest.mark.skipif(PURE, reason="FANOUT_PURE_PYTHON is set: the twin runs on purpose")
def test_the_fan_out_writer_runs_compiled_where_a_c_compiler_is_installed() -> None:
    if not _can_compile():
        pytest.skip("no C compiler or Python headers: the Python twin runs")
    from gateway import _fanwrite  # an ImportError here: the build dropped it (make setup rebuilds)

    assert fanwrite.Sender is _fanwrite.Sender
    assert fanwrite.BUILD == "compiled"


def test_fanout_pure_python_at_run_time_chooses_the_twin_and_says_so() -> None:
    assert _choice("1") == {"build": "python (FANOUT_PURE_PYTHON)", "module": "gateway.fanwrite_py"}
    unset = _choice("0")
    if unset["build"] == "compiled":  # built here
        assert unset["module"] == "gateway._fanwrite"
    else:
        assert unset == {"build": "python (not built)", "module": "gateway.fanwrite_py"}


def test_without_the_compiled_module_the_twin_runs_and_says_so() -> None:
    assert _choice("", "hide") == {"build": "python (not built)", "module": "gateway.fanwrite_py"}


def test_the_sender_in_this_process_is_the_one_build_names() -> None:
    twin = fanwrite.Sender is fanwrite_py.Sender
    assert fanwrite.BUILD.startswith("python (") if twin else fanwrite.BUILD == "compiled"
