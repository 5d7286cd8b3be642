"""Settings for the whole suite.

Hypothesis runs derandomized under CI (`CI` set, as `.ci/run` is run): each property test then draws the same
examples on every machine, so the run CI makes on a fresh clone is the run made here with `CI=true make test`,
and a failure it finds is reproduced by rerunning. Locally, without CI, the draws stay random and keep
exploring (and a failure found is kept in .hypothesis/ and replayed first).
"""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
