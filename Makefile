# Two commands on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# pytest-xdist, two workers: each test module runs in one worker and every Ray test in one worker
# (tests/conftest.py, helpers.RAY_GROUP); scripts/loso.py and make_docs --check run in the background from the
# session's start (tests/slow_scripts.py). Measured back to back on a 2-core machine: pytest 1432 s serial, 1114 s
# with two workers (serially the tests wait on real processes: `time` counted 870 s of CPU in the 1432 s).
# Serial: make test PYTEST_FLAGS=
PYTEST_FLAGS ?= -n 2 --dist loadgroup

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
