"""The security suite reuses the gateway tests' clients (tests/gateway/gw_helpers.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gateway"))
