# The two commands of the README: `make run` and `make test`. Each sets itself up, with what it needs only:
# `make run` what serving needs (pyproject.toml `dependencies`) and the compiled core; `make test` (`make check`,
# `make setup`) those and every extra besides (the test toolchain, Spark, matplotlib, pyarrow: ~1 GB more).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# One stamp per set installed: the serving set (`make run`), the full set (`make setup`, `make test`, `make check`).
RUN_STAMP := $(VENV)/.installed-run
STAMP := $(VENV)/.installed
# pyproject.toml's requirements, one a line, for pip: `serve` (the dependencies) or `all` (with every extra's)
REQUIREMENTS = $(BIN)/python -c 'import sys, tomllib; project = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
	extras = [r for group in project["optional-dependencies"].values() for r in group] if sys.argv[1] == "all" else []; \
	print("\n".join(dict.fromkeys(project["dependencies"] + extras)))'
# Every package either set installs, pinned (==) down to the last transitive one: pyproject.toml's dependencies and
# every extra's, resolved together on Python 3.11 (`make lock` writes it again). Every install below is held to it
# (-c; the core's build environment too, --build-constraint), pip and setuptools included.
CONSTRAINTS := constraints.txt
# What the venv holds that $(CONSTRAINTS) does not name (left by an older set, such as uvicorn[standard]'s
# watchfiles), uninstalled after each install: the venv then holds the locked packages and the gateway only.
UNLOCKED = $(BIN)/python -c 'import importlib.metadata as m, re, sys; key = lambda n: re.sub(r"[-_.]+", "-", n).lower(); \
	locked = {key(line.partition("==")[0]) for line in open(sys.argv[1]) if "==" in line} | {"fanout-gateway"}; \
	print(" ".join(sorted({d.metadata["Name"] for d in m.distributions() if key(d.metadata["Name"]) not in locked})))'
SYNC = unlocked="$$($(UNLOCKED) $(CONSTRAINTS))"; test -z "$$unlocked" || $(BIN)/pip uninstall -q -y $$unlocked

# A venv set up before the serving set had a stamp of its own (only .installed, the full set) holds it already.
ifneq ($(wildcard $(STAMP)),)
ifeq ($(wildcard $(RUN_STAMP)),)
$(shell touch -r $(STAMP) $(RUN_STAMP))
endif
endif

# The serving set. Also rebuilds the compiled core (setup.py) when one of its sources changes: a stale build never
# runs (core/native.py falls back to the sources). What the build needs ([build-system]: setuptools, mypy for
# mypyc, orjson) pip puts in a build environment of its own, not in .venv, at the pins of $(CONSTRAINTS) too; the
# C compiler and the Python headers (gcc, python3-dev) are the system's (without them the core runs as Python).
$(RUN_STAMP): pyproject.toml $(CONSTRAINTS) setup.py $(wildcard core/*.py)
	@echo "setting up $(VENV) for serving: about a minute (once; again only when pyproject.toml, $(CONSTRAINTS),"
	@echo "setup.py or core/*.py change)"
	@echo "[1/3] $(VENV), with pip and setuptools at their pins ($(CONSTRAINTS))"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade -c $(CONSTRAINTS) pip setuptools
	@echo "[2/3] what serving needs (pyproject.toml dependencies, at the pins of $(CONSTRAINTS))"
	$(REQUIREMENTS) serve > $(VENV)/requirements-serve.txt
	$(BIN)/pip install -r $(VENV)/requirements-serve.txt -c $(CONSTRAINTS)
	@echo "[3/3] the gateway itself, editable, compiling the core with mypyc (30 s on 2 cores, minutes on a slow"
	@echo "      machine; pip is quiet meanwhile)"
	$(BIN)/pip install -q -e . -c $(CONSTRAINTS) --build-constraint $(CONSTRAINTS)
	$(SYNC)
	touch $(RUN_STAMP)

# The full set: the serving set, then every extra (pyproject.toml `[project.optional-dependencies]`: `dev`,
# `tracing`, `loadtest`, `pipeline`) installed beside it, at the pins of $(CONSTRAINTS) (no second compile).
$(STAMP): $(RUN_STAMP) $(CONSTRAINTS)
	@echo "[+] the test toolchain and every extra (pytest, mypy, ruff, hypothesis, Spark, matplotlib, pyarrow, ...):"
	@echo "    about 1 GB more (half a minute from pip's cache, minutes to download)"
	$(REQUIREMENTS) all > $(VENV)/requirements-all.txt
	$(BIN)/pip install -r $(VENV)/requirements-all.txt -c $(CONSTRAINTS)
	$(SYNC)
	touch $(STAMP)

setup: $(STAMP)

# $(CONSTRAINTS) again, from pyproject.toml: its dependencies, every extra's, [build-system]'s and pip, resolved
# together afresh by pip's dry run (nothing is installed) on this machine's Python 3.11, every package the resolution
# brings pinned at the version it chose (the newest the pins allow). In a venv of its own, not .venv: setting .venv
# up would install with the very file being replaced, which a changed pin contradicts. Then `make setup` installs it.
LOCK_VENV := $(VENV)-lock
lock: BIN = $(LOCK_VENV)/bin
lock:
	@$(PY) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11) and "make lock resolves on Python 3.11: make lock PY=python3.11")'
	rm -rf $(LOCK_VENV) && $(PY) -m venv $(LOCK_VENV)
	$(REQUIREMENTS) all > $(LOCK_VENV)/requirements.txt
	$(BIN)/python -c 'import tomllib; print("\n".join(["pip", *tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]]))' \
		>> $(LOCK_VENV)/requirements.txt
	$(BIN)/pip install -q --dry-run --ignore-installed --report $(LOCK_VENV)/resolution.json -r $(LOCK_VENV)/requirements.txt
	$(BIN)/python -c 'import json, sys; chosen = [p["metadata"] for p in json.load(open(sys.argv[1]))["install"]]; \
		print("# Every package of pyproject.toml (its dependencies, every extra, [build-system]) and pip, pinned: the set"); \
		print("# resolved on Python 3.11 (Linux) that `make run` and `make setup` install with (pip -c). Not edited by hand:"); \
		print("# change pyproject.toml, then `make lock` writes this again (tests/packaging/test_constraints.py checks both).\n"); \
		print("\n".join(p["name"] + "==" + p["version"] for p in sorted(chosen, key=lambda p: p["name"].lower())))' \
		$(LOCK_VENV)/resolution.json > $(LOCK_VENV)/constraints.txt
	mv $(LOCK_VENV)/constraints.txt $(CONSTRAINTS)
	rm -rf $(LOCK_VENV)

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

# `make image` and the image test build the Containerfile on bases mmdebstrap makes and run it with podman on runc
# (tests/deploy/test_container.py; docs/operations.md, "Container and Kubernetes").
podman:
	@command -v podman >/dev/null 2>&1 && command -v runc >/dev/null 2>&1 && command -v mmdebstrap >/dev/null 2>&1 || \
		(apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q podman runc mmdebstrap)

# The container image (Containerfile), as `fanout-gateway`, by deploy/container/build-image.py (--help): on Debian
# bookworm bases that mmdebstrap makes here (cached in ~/.cache/fanout-gateway/; about two minutes, once), its Python
# packages from a wheelhouse pip fills on this machine, so no container registry is needed; about a minute once the
# bases are cached. `make image BASE_IMAGE=python:3.11-slim` builds on that registry image instead, the usual way.
BASE_IMAGE ?=
image: podman $(RUN_STAMP)
	$(BIN)/python deploy/container/build-image.py$(if $(BASE_IMAGE), --base-image $(BASE_IMAGE))

# The browser library's reconnect logic is also tested under Node.js (tests/client/test_fanout_js_drain.py).
node:
	@command -v node >/dev/null 2>&1 || (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q nodejs)

# Centrifugo's JavaScript SDK and `ws`, pinned by their lock file, for tests/gateway/test_centrifugo_js.py: a folder of
# the tests, not of the product.
CENTRIFUGO_JS = tests/centrifugo_js
centrifugo-js: node $(CENTRIFUGO_JS)/node_modules/.package-lock.json
$(CENTRIFUGO_JS)/node_modules/.package-lock.json: $(CENTRIFUGO_JS)/package.json $(CENTRIFUGO_JS)/package-lock.json
	npm ci --prefix $(CENTRIFUGO_JS) --no-audit --no-fund

run: $(RUN_STAMP)
	$(BIN)/gateway serve

# Lint and types first (pyproject.toml: ruff; mypy strict on the sans-I/O core, the Python client and gateway/, typed
# definitions in loadtest/, pipeline/, tests/ and deploy/container/). Two mypy runs, each with its own cache: a cache
# holds one set of options, so runs with different ones sharing it would recheck everything each time. Lint (and so
# `make check`) sets up .venv when it is missing or older than pyproject.toml, $(CONSTRAINTS) or setup.py, but not
# for an edit of core/*.py: the core then runs from its sources (a stale build never runs); `make setup`, `make
# test`, `make durations` and `make run` compile it again.
LINT_SETUP = $(shell test $(STAMP) -nt pyproject.toml -a $(STAMP) -nt $(CONSTRAINTS) -a $(STAMP) -nt setup.py || echo $(STAMP))
lint: $(LINT_SETUP)
	$(BIN)/ruff check core gateway fanout_client loadtest pipeline tests deploy/container
	$(BIN)/ruff format --check core gateway fanout_client loadtest pipeline tests deploy/container
	$(BIN)/mypy --strict core fanout_client gateway
	$(BIN)/mypy --cache-dir .mypy_cache/typed loadtest pipeline tests deploy/container

# Then every test, on both cores (pytest-xdist; a module's tests stay together in one worker, so its fixtures and
# ports are its own), with the 15 slowest named; then the core's own tests once more on its pure-Python fallback
# (FANOUT_PURE_PYTHON, core/native.py). Three workers took 12 minutes against 14.5, but timed tests then failed
# now and then: two workers until those tests no longer depend on a quiet machine.
# The modules go longest first (tests/conftest.py, from tests/durations.json), not most tests first.
test: $(STAMP) lint java browser redis iproute netcat node centrifugo-js podman
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15
	FANOUT_PURE_PYTHON=1 $(BIN)/python -m pytest -q tests/core

# tests/durations.json again from a whole run: each module's seconds, which `make test` orders modules by.
durations: $(STAMP) lint java browser redis iproute netcat node centrifugo-js
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --record-durations tests/durations.json

# The fast lane: ruff, mypy and the unit tests (in-process only, tests/conftest.py), under a minute; no Java,
# browser or Redis needed. `make test` still runs everything. Only the modules holding unit tests are imported
# (tests/conftest.py), and Hypothesis draws a fifth of its examples (FANOUT_HYPOTHESIS=quick; `make test` and CI
# the full count). Bytecode is written even where the environment says not to (PYTHONDONTWRITEBYTECODE): without
# it every run compiles every module and rewrites every test's asserts again, 5 of the minute.
check: lint
	FANOUT_HYPOTHESIS=quick PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -m unit -p no:cacheprovider -n 2

bench: $(STAMP)
	$(BIN)/python -m loadtest core

clean:
	rm -rf $(VENV) .pytest_cache build dist core/*.so core/_compiled.json *__mypyc*.so
