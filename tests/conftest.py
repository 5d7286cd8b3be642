"""Settings for the whole suite.

Hypothesis runs derandomized under CI (`CI` set, as `.ci/run` is run): each property test then draws the same
examples on every machine, so the run CI makes on a fresh clone is the run made here with `CI=true make test`,
and a failure it finds is reproduced by rerunning. Locally, without CI, the draws stay random and keep
exploring (and a failure found is kept in .hypothesis/ and replayed first).

Two lanes. A *unit* test starts no server, subprocess, browser, Spark session or redis-server: it runs in
this process only (the core, parsers, schemas and config, pipeline and load-tool parts fed directly). A
module of unit tests says so with ``pytestmark = pytest.mark.unit``; a module that mixes both kinds names
its unit tests in ``UNIT_TESTS`` below. Every other test is marked *integration* here. `make check` runs
ruff, mypy and ``-m unit`` (under a minute); `make test` runs everything.

Longest modules first. `make test` spreads whole modules over two workers (`--dist loadfile`); pytest-xdist
would send the modules with the most tests first, which leaves the long single-test ones (the wheel, the chaos
runs, Spark) for the end, where one worker runs them while the other waits. So each worker orders the modules
by the seconds they took (tests/durations.json, written by `make durations`), longest first: a module's time
changes slowly, and a stale figure only costs balance, never a result.
"""

import json
import os
from collections import defaultdict

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
# `make check`'s profile (FANOUT_HYPOTHESIS=quick): at most QUICK_EXAMPLES examples for a test that sets no count
# of its own (one with `@settings(max_examples=...)` keeps it), for a fast lane; `make test` and CI draw them all.
QUICK_EXAMPLES = 20
QUICK = not os.environ.get("CI") and os.environ.get("FANOUT_HYPOTHESIS") == "quick"
settings.register_profile("quick", max_examples=QUICK_EXAMPLES)
if os.environ.get("CI"):
    settings.load_profile("ci")
elif QUICK:
    settings.load_profile("quick")

#: modules with both kinds: their unit tests by function name (the others start a server, a process or Spark)
UNIT_TESTS: dict[str, frozenset[str]] = {
    # one test imports the ingest client in a fresh interpreter
    "tests/client/test_stream.py": frozenset(
        {
            "test_duplicates_dropped_losses_passed_on_holes_reported_epochs_restart",
            "test_snapshot_jumps_are_conflation_and_private_takeovers_drop_redeliveries",
        }
    ),
    # one test forks a second worker
    "tests/security/test_edge_addrcount.py": frozenset(
        {
            "test_counts_read_the_cluster_and_writes_stay_exact_per_worker",
            "test_another_worker_changing_its_count_between_our_read_and_write_is_not_taken_for_ours",
            "test_shared_token_buckets_count_every_workers_takes_and_refill_at_the_rate",
        }
    ),
    # the sans-I/O client; publish() and Publisher run against a socket server (pipeline_ingest_double.py)
    "tests/pipeline/test_pipeline_ingest.py": frozenset(
        {
            "test_encode_record_reencodes_data_as_json_value",
            "test_encode_record_refuses_data_that_is_not_one_json_value",
            "test_encode_record_refuses_missing_topic",
            "test_client_counts_lines_and_accepts_already_landed",
            "test_client_checks_each_sync_of_a_connection_separately",
            "test_client_sums_the_syncs_of_a_connection",
            "test_client_reassembles_answers_split_anywhere",
            "test_client_raises_the_gateway_message_for_other_errors",
            "test_client_rejects_inconsistent_answers",
            "test_client_fails_when_the_connection_closes_before_synced",
            "test_client_refuses_misuse",
            "test_client_answer_parser_never_raises_anything_else",
            "test_compress_expand_round_trip",
        }
    ),
    # the ledger's classification and files; one test runs the feed on Spark
    "tests/pipeline/test_pipeline_ledger.py": frozenset(
        {
            "test_intervals",
            "test_first_attempt",
            "test_replay_after_a_recorded_outcome_uses_it",
            "test_replay_after_an_attempt_that_died_is_landed_but_unverified",
            "test_replay_in_a_new_epoch_is_a_first_attempt_there",
            "test_ledger_round_trip",
        }
    ),
}

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: how a module marks unit tests (``pytestmark = pytest.mark.unit`` or ``@pytest.mark.unit``): a module whose
#: source never says it, and is not in UNIT_TESTS, holds none
_UNIT_MARK = "mark.unit"


def _may_hold_unit_tests(module: str) -> bool:
    if module in UNIT_TESTS:
        return True
    try:
        with open(os.path.join(_ROOT, module), encoding="utf-8") as file:
            return _UNIT_MARK in file.read()
    except OSError:
        return True


def pytest_ignore_collect(collection_path: "os.PathLike[str]", config: pytest.Config) -> bool | None:
    """Under ``-m unit`` alone (`make check`), skip importing the modules that hold no unit test: each worker
    would import every integration module (Spark, Playwright, the load tool) only to deselect all it collected."""
    name = os.path.basename(collection_path)
    if config.getoption("markexpr") != "unit" or not (name.startswith("test_") and name.endswith(".py")):
        return None
    return None if _may_hold_unit_tests(os.path.relpath(collection_path, _ROOT).replace(os.sep, "/")) else True


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = _module(item)
        if item.get_closest_marker("unit") is not None:
            if not _may_hold_unit_tests(module):  # `make check` would not collect it (pytest_ignore_collect)
                raise pytest.UsageError(
                    f"{item.nodeid} is marked unit in a way {module} does not say in its "
                    f"source ({_UNIT_MARK!r}): name it in UNIT_TESTS (tests/conftest.py)"
                )
            continue
        name = getattr(item, "originalname", item.name)
        if name in UNIT_TESTS.get(module, ()):
            item.add_marker(pytest.mark.unit)
        else:
            item.add_marker(pytest.mark.integration)
    _longest_modules_first(items)


def _module(item: pytest.Item) -> str:
    return os.path.relpath(str(item.path), _ROOT).replace(os.sep, "/")


DURATIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "durations.json")
#: a module not in tests/durations.json yet (a new one: usually short)
NEW_MODULE_SECONDS = 5.0


def _longest_modules_first(items: list[pytest.Item]) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # one process runs everything anyway: the collected order
    try:
        with open(DURATIONS) as file:
            seconds: dict[str, float] = json.load(file)
    except (OSError, ValueError):
        return
    items.sort(key=lambda item: -seconds.get(_module(item), NEW_MODULE_SECONDS))  # stable: a module's order kept


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-durations",
        metavar="PATH",
        help="write each module's seconds (setup, call and "
        "teardown of all its tests) to PATH, as tests/durations.json holds them",
    )


_seconds: defaultdict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _seconds[report.nodeid.split("::")[0]] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = session.config.getoption("--record-durations")
    if path and not os.environ.get("PYTEST_XDIST_WORKER") and _seconds:
        with open(path, "w") as file:
            json.dump({module: round(value, 1) for module, value in sorted(_seconds.items())}, file, indent=0)
            file.write("\n")
