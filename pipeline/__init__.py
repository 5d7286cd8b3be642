"""Spark (PySpark) data pipeline of the fan-out gateway.

* ``python -m pipeline feed``: Structured Streaming from a growing directory of files or the ``rate`` source
  into the gateway's TCP ingest (:mod:`pipeline.feed`, sink in :mod:`pipeline.ingest`).
* ``python -m pipeline audit``: a load tester's delivery log -> fairness report (:mod:`pipeline.audit`),
  whose figures are defined once in :mod:`pipeline.figures` and recomputed in pure Python by
  :mod:`pipeline.reference`.

See docs/pipeline.md.
"""
