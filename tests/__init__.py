"""The test suite: a package, so helpers are imported by their path (tests.gateway.gw_helpers)."""
