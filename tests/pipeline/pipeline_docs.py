"""The shell commands of docs/pipeline.md, for the tests that run them (test_pipeline_docs.py locally,
test_pipeline_cluster.py on a standalone cluster)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "pipeline.md"


def commands(text: str | None = None) -> list[str]:
    """Every command of the ```sh blocks, continuation lines joined, comments and blank lines left out."""
    text = DOC.read_text() if text is None else text
    out = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split("  #")[0].strip() if not line.lstrip().startswith("#") else ""
            if line:
                out.append(re.sub(r"\s+", " ", line))
    return out


#: The venv's programs the document names, as the words the tests run in-process: the console script
#: `fanout-pipeline` is `pipeline.__main__:main`, i.e. `python -m pipeline`.
VENV_PROGRAMS = {".venv/bin/fanout-pipeline": ["python", "-m", "pipeline"], ".venv/bin/python": ["python"]}


def argv(command: str, substitutions: dict[str, str]) -> list[str]:
    """The command's words after replacing each key of ``substitutions`` (longest first) in its text, the
    venv's programs written as VENV_PROGRAMS says."""
    for old in sorted(substitutions, key=len, reverse=True):
        command = command.replace(old, substitutions[old])
    words = shlex.split(command)
    return VENV_PROGRAMS.get(words[0], words[:1]) + words[1:] if words else words


CLUSTER_MASTER = "spark://spark-master:7077"


def is_cluster_command(command: str) -> bool:
    return CLUSTER_MASTER in command or command.startswith("zip ")
