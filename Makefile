# The two commands of the README: `make run` and `make test`. Each sets itself up.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test durations check lint setup java browser redis iproute netcat node centrifugo-js bench clean

# Also rebuilds the compiled core (setup.py) when one of its sources changes: a stale build never runs
# (core/native.py falls back to the sources).
$(STAMP): pyproject.toml setup.py $(wildcard core/*.py)
	@echo "setting up $(VENV): installing the dependencies and compiling the core with mypyc (about 2-3 minutes,"
	@echo "once; again only when pyproject.toml, setup.py or core/*.py change). pip is quiet meanwhile."
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# Spark (pipeline tests) needs Java 17+; install Debian's JRE when missing.
java:
	@java -version >/dev/null 2>&1 || (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q openjdk-17-jre-headless)

# Page tests drive Debian's headless Chromium.
browser:
	@command -v chromium >/dev/null 2>&1 || (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium)

# Cluster tests (docs/cluster.md) start a real redis-server on a free port.
redis:
	@command -v redis-server >/dev/null 2>&1 || (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server)

# The load tool counts a server's TCP segments with `ss` (iproute2; tests/loadtest/test_segments.py).
iproute:
	@command -v ss >/dev/null 2>&1 || (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q iproute2)

# The README's demo publishes with nc (tests/docs/test_doc_commands.py runs it as written).
netcat:
	@command -v nc >/dev/null 2>&1 || (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q netcat-openbsd)

# The browser library's reconnect logic is also tested under Node.js (tests/client/test_fanout_js_drain.py).
node:
	@command -v node >/dev/null 2>&1 || (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q nodejs)

# Centrifugo's JavaScript SDK and `ws`, pinned by their lock file, for tests/gateway/test_centrifugo_js.py: a folder of
# the tests, not of the product.
CENTRIFUGO_JS = tests/centrifugo_js
centrifugo-js: node $(CENTRIFUGO_JS)/node_modules/.package-lock.json
$(CENTRIFUGO_JS)/node_modules/.package-lock.json: $(CENTRIFUGO_JS)/package.json $(CENTRIFUGO_JS)/package-lock.json
	npm ci --prefix $(CENTRIFUGO_JS) --no-audit --no-fund

run: $(STAMP)
	$(BIN)/gateway serve

# Lint and types first (pyproject.toml: ruff; mypy strict on the sans-I/O core, the Python client and gateway/, typed
# definitions in loadtest/, pipeline/ and tests/). Two mypy runs, each with its own cache: a cache holds one set of
# options, so runs with different ones sharing it would recheck everything each time.
lint: $(STAMP)
	$(BIN)/ruff check core gateway fanout_client loadtest pipeline tests
	$(BIN)/mypy --strict core fanout_client gateway
	$(BIN)/mypy --cache-dir .mypy_cache/typed loadtest pipeline tests

# Then every test, on both cores (pytest-xdist; a module's tests stay together in one worker, so its fixtures and
# ports are its own), with the 15 slowest named; then the core's own tests once more on its pure-Python fallback
# (FANOUT_PURE_PYTHON, core/native.py). Three workers took 12 minutes against 14.5, but timed tests then failed
# now and then: two workers until those tests no longer depend on a quiet machine.
# The modules go longest first (tests/conftest.py, from tests/durations.json), not most tests first.
test: lint java browser redis iproute netcat node centrifugo-js
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15
	FANOUT_PURE_PYTHON=1 $(BIN)/python -m pytest -q tests/core

# tests/durations.json again from a whole run: each module's seconds, which `make test` orders modules by.
durations: lint java browser redis iproute netcat node centrifugo-js
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --record-durations tests/durations.json

# The fast lane: ruff, mypy and the unit tests (in-process only, tests/conftest.py), under a minute; no Java,
# browser or Redis needed. `make test` still runs everything. Bytecode is written even where the environment says
# not to (PYTHONDONTWRITEBYTECODE): without it every run compiles every module and rewrites every test's asserts
# again, 5 of the minute.
check: lint
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -m unit -p no:cacheprovider -n 2

bench: $(STAMP)
	$(BIN)/python -m loadtest core

clean:
	rm -rf $(VENV) .pytest_cache build dist core/*.so core/_compiled.json *__mypyc*.so
