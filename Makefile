# Two commands for a fresh machine: `make run` and `make test`.
# Everything else here is what those two need.

VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
RUNTIME := $(VENV)/.runtime-installed
TESTDEP := $(VENV)/.test-installed
FWVENV  ?= .venv-frameworks
FWDEP   := $(FWVENV)/.installed
NODECLI := tests/frameworks/node
NODEDEP := $(NODECLI)/node_modules/.installed
K8SSCH  := tests/k8s_schemas
K8SDEP  := $(K8SSCH)/node_modules/.installed
STUBS   := duplex/v1/talker_pb2_grpc.py
PROTOS  := $(wildcard protos/duplex/v1/*.proto)

# Options for `make run`, e.g. `make run ARGS="--checkpoint /models/personaplex --sessions 4"`.
ARGS    ?=
# Options for pytest, e.g. `make test PYTEST_ARGS="-k mimi -x"`.
PYTEST_ARGS ?=

.PHONY: run test lint setup setup-test setup-frameworks setup-node-clients setup-k8s-schemas stubs checkpoint clean

run: setup stubs
	$(PY) -m tools.run_stack $(ARGS)

test: setup-test lint setup-frameworks setup-node-clients setup-k8s-schemas stubs
	$(PY) -m pytest $(PYTEST_ARGS)

# ruff with pyproject's [tool.ruff] (120 columns, pycodestyle + pyflakes); any finding fails the build.
lint: setup-test
	$(PY) -m ruff check .

setup: $(RUNTIME)
setup-test: $(TESTDEP)
setup-frameworks: $(FWDEP)
setup-node-clients: $(NODEDEP)
setup-k8s-schemas: $(K8SDEP)

# CPU machines install the local torch 2.13.0 build first (a range would pull a
# multi-GB CUDA build); the GPU image's own torch is used there instead.
$(RUNTIME): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e .
	touch $@

# Test-only: the numerical reference `moshi==0.2.13`, installed without its
# dependencies (it pins an older torch); never imported by runtime code.
$(TESTDEP): $(RUNTIME)
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps moshi==0.2.13
	touch $@

# Test-only: the voice-agent framework clients (pyproject's [tool.personaplex] framework-test-clients),
# in their own venv: pipecat pins protobuf<7, the runtime's grpcio-tools needs protobuf>=7.35.
$(FWDEP): pyproject.toml
	test -x $(FWVENV)/bin/python || python3 -m venv $(FWVENV)
	$(FWVENV)/bin/python -m pip install -q --upgrade pip
	python3 -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['tool']['personaplex']['framework-test-clients']))" > $(FWVENV)/requirements.txt
	$(FWVENV)/bin/python -m pip install -q -r $(FWVENV)/requirements.txt
	touch $@

# Test-only: the Node.js openai SDK that tests/test_frameworks.py drives over wss, at the versions
# tests/frameworks/node/package-lock.json pins, from the npm registry into its git-ignored node_modules.
$(NODEDEP): $(NODECLI)/package.json $(NODECLI)/package-lock.json
	cd $(NODECLI) && npm ci --no-audit --no-fund --loglevel=error
	touch $@

# Test-only: the Gateway API and Prometheus Operator models (and TypeScript) that tests/test_k8s_components.py
# validates k8s/components against, pinned by tests/k8s_schemas/package-lock.json.
$(K8SDEP): $(K8SSCH)/package.json $(K8SSCH)/package-lock.json
	cd $(K8SSCH) && npm ci --no-audit --no-fund --loglevel=error
	touch $@

# gRPC stubs are generated from protos/ at install time, never committed.
stubs: $(STUBS)
$(STUBS): $(PROTOS) $(RUNTIME)
	$(PY) -m grpc_tools.protoc -I protos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)
	touch $@

# The embedded tiny checkpoint (generated once, cached under .cache/).
checkpoint: setup stubs
	$(PY) -m tools.make_checkpoint --preset tiny

clean:
	rm -rf duplex .cache .pytest_cache
