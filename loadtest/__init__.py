"""Load generator for the fan-out gateway: ``python -m loadtest`` (see docs/loadtest.md)."""
