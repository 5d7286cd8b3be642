"""The Python client's tests run against real gateways (gateway.testing.run_gateway) on 127.0.0.1.

The repository root goes first on sys.path so that ``fanout_client`` is importable however pytest is started
(``python -m pytest`` adds the working directory, the ``pytest`` script does not, and an editable install
made before the package existed does not list it). tests/e2e holds the TCP proxy that cuts connections.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "tests" / "e2e"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
