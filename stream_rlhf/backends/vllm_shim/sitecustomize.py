"""Import shim for a vLLM engine whose environment has no torchvision: lets vLLM serve Qwen2-VL and Qwen3-VL.

Why: vLLM's `model_executor/models/qwen2_vl.py` imports `smart_resize` from transformers'
`qwen2_vl/image_processing_qwen2_vl.py`, which imports torchvision, and transformers'
`Qwen2VLProcessor` and `Qwen3VLProcessor` always load a torchvision-backed video processor. There is no CPU build of
torchvision for torch 2.13 (the registry's is CUDA-linked, and `scripts/setup_vllm_cpu.sh` removes
it), so in vLLM's CPU environment both fail.

What it patches, lazily, when (and only if) the modules are imported:
  - `transformers.models.qwen2_vl.image_processing_qwen2_vl` is the PIL image processor's module
    (`image_processing_pil_qwen2_vl`: the same `smart_resize`, no torchvision);
  - `Qwen2VLProcessor` and `Qwen3VLProcessor` load no video processor; the image processor stands
    in where vLLM reads the video processor's kwargs (the engine takes no video:
    `limit_mm_per_prompt` video 0).

How: Python imports `sitecustomize` at start-up in every process whose PYTHONPATH holds this
folder, so vLLM's engine core and worker processes get it too. `vllm_client.engine_env` puts the
folder on the engine process's PYTHONPATH when the engine's Python has no torchvision; with a
torchvision (a GPU install) it is left out. This folder is not a package: it is a PYTHONPATH entry
shipped as package data.
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

QWEN2_VL = "transformers.models.qwen2_vl."
PROCESSORS = {QWEN2_VL + "processing_qwen2_vl": "Qwen2VLProcessor",
              "transformers.models.qwen3_vl.processing_qwen3_vl": "Qwen3VLProcessor"}
"""Module -> the processor class in it that must load no video processor."""


def _drop_video_processor(module: ModuleType) -> None:
    processor = getattr(module, PROCESSORS[module.__name__])
    init = processor.__init__

    # no video_processor argument: transformers loads the sub-processors named in __init__
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        init(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)
        self.video_processor = image_processor

    processor.__init__ = __init__


class _PatchedLoader(importlib.abc.Loader):
    """Loads `real`'s module, then applies `patch` to it."""

    def __init__(self, real: importlib.abc.Loader, patch: Callable[[ModuleType], None]):
        self.real, self.patch = real, patch

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.real.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.real.exec_module(module)
        self.patch(module)


class _AliasLoader(importlib.abc.Loader):
    """Gives the module `target` under the name being imported."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        pass


class _QwenVLWithoutTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None) -> ModuleSpec | None:
        if name == QWEN2_VL + "image_processing_qwen2_vl":
            return importlib.util.spec_from_loader(name, _AliasLoader(QWEN2_VL + "image_processing_pil_qwen2_vl"))
        if name in PROCESSORS:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            spec.loader = _PatchedLoader(spec.loader, _drop_video_processor)
            return spec
        return None


sys.meta_path.insert(0, _QwenVLWithoutTorchvision())
