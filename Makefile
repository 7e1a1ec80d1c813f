# Two commands on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# `make test PYTEST_FLAGS="-n 2 --dist loadgroup"`: two pytest-xdist workers, each test module in one worker and
# every Ray test in one worker (tests/conftest.py, helpers.RAY_GROUP). Not the default: measured at load 3-6, e2e
# went 1147 -> 943 s, the service tests stayed ~575 s, and the extra load made a timing-bound Ray test fail once.
PYTEST_FLAGS ?=

.PHONY: demo test lint typecheck bench clean install docs

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: the CPU build on disk; an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[train,dev,ray,service]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/starverse demo

test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy
	$(BIN)/pytest -q $(PYTEST_FLAGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

# every benchmark, its JSON kept in benchmarks/results/ and rendered into README.md (make docs)
bench: $(STAMP)
	$(BIN)/python scripts/run_benches.py
	$(BIN)/python scripts/make_docs.py

# the planner's verdict and benchmark tables in README.md and docs/planner.md, from the real commands' --json
# (benchmark figures: from benchmarks/results/bench_plan.json, written by `bench_plan.py --save`)
docs: $(STAMP)
	$(BIN)/python scripts/make_docs.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
