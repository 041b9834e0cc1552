# duetime — two commands on a fresh machine: `make run` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PIP     := $(BIN)/python -m pip
STAMP   := $(VENV)/.installed
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt

.PHONY: run demo test lint format bench bench-sim bench-peers bench-serve-peers clean setup

setup: $(STAMP)

# torch first, from the CPU wheel on local disk, pinned by constraints.txt so that
# nothing installed later can swap it for a CUDA build.
$(STAMP): pyproject.toml constraints.txt
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

# The main job: the OpenAI-compatible server on the packaged Gemma 3 270M (Ctrl-C stops it).
run: $(STAMP)
	$(BIN)/duetime serve --model gemma --policy edf --port 8000

# The simulator in one command: ShareGPT through FCFS and EDF, table + out/demo.png.
demo: $(STAMP)
	$(BIN)/duetime demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

CSRC := $(wildcard src/duetime/engine/csrc/*.cpp src/duetime/engine/csrc/*.h)

lint: $(STAMP)
	$(BIN)/ruff check src tests scripts
	$(BIN)/ruff format --check src tests scripts
	$(BIN)/mypy src scripts
	$(BIN)/clang-format --dry-run --Werror $(CSRC)

format: $(STAMP)
	$(BIN)/ruff format src tests scripts
	$(BIN)/ruff check --fix src tests scripts
	$(BIN)/clang-format -i $(CSRC)

# Every reproduction that needs no real-engine run (simulator, cost models, predictors),
# each writing out/bench/<name>.json and, where it plots, .png: about 3 minutes on 2 cores.
# The real-engine runs (`duetime bench <name> --engine`, `bench engine`, `bench serve`)
# take minutes each and are listed in README.md.
BENCH_SIM_PLOTS := amin deferred-prefill timelyllm timebill ala sensitivity predict-length
bench: $(STAMP)
	mkdir -p out/bench
	$(BIN)/duetime bench sim --json out/bench/sim.json
	set -e; for b in $(BENCH_SIM_PLOTS); do \
		$(BIN)/duetime bench $$b --json out/bench/$$b.json --plot out/bench/$$b.png; \
	done

bench-sim: $(STAMP)
	$(BIN)/duetime bench sim

# Opt-in: llama.cpp side by side in `duetime bench engine`. llama-cpp-python compiles
# llama.cpp from source (cmake + g++; tens of minutes on 2 busy cores), installed
# with constraints.txt so torch and friends stay pinned; then one short bench run that
# prints every issue-#4 ratio (prefill 512, decode batch 1 and 16 vs llama.cpp and bf16).
LLAMA_CPP_VERSION ?= 0.3.36
bench-peers: $(STAMP)
	$(PIP) install -c constraints.txt "llama-cpp-python==$(LLAMA_CPP_VERSION)"
	$(BIN)/duetime bench engine --engine q8 --transformers bf16 \
		--prefill 512 --batch 1,16 --json out/bench-engine-peers.json

# Opt-in: `duetime serve` beside vLLM CPU and llama-server under the same load
# (`vllm bench serve` and `duetime load`, rates 1/4/inf), one server at a time.
# The first run installs vLLM CPU in its own venv (~15 min, ~13 GB under
# ~/.cache/duetime-peers) and builds llama-server (~8 min); then about 40 minutes.
# Options (PEERS, PEERS_OUT, PEERS_CACHE, DUETIME_SERVE_ARGS, ...): docs/serve-peers.md.
bench-serve-peers: $(STAMP)
	bash scripts/serve_peers.sh

clean:
	rm -rf $(VENV) build dist *.egg-info src/*.egg-info .pytest_cache .ruff_cache .mypy_cache
