"""Process plumbing for `server.workers > 1`: the supervisor that runs the worker processes, and the
forwarder that routes a session's requests to the worker that holds it (docs/cluster.md)."""
