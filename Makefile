# Build everything from nothing: `make demo` (the end-to-end CPU training), `make test` (the test suite) and
# `make serve` (the daemon) need only python3.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: venv demo test serve bench lint clean

# torch first, pinned: this machine carries the CPU build of 2.13.0 on disk; an unpinned torch (or a package
# asking for a newer one) would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

test: venv
	$(BIN)/ruff check aglverl tests benchmarks examples
	$(BIN)/pytest -q

demo: venv
	$(BIN)/aglverl demo --out demo-out

serve: venv
	$(BIN)/aglverl serve

bench: venv
	$(BIN)/python benchmarks/turnaround.py
	$(BIN)/python benchmarks/batch_build.py
	$(BIN)/python benchmarks/proxy.py
	$(BIN)/python benchmarks/control_plane.py

lint: venv
	$(BIN)/ruff check aglverl tests benchmarks examples
	$(BIN)/mypy aglverl

clean:
	rm -rf $(VENV) build *.egg-info
