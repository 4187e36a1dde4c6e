"""The weight-sync side of a vLLM worker: mixed into every worker of the rollout's engine.

    EngineArgs(..., worker_extension_cls="stream_rlhf.backends.vllm_worker.WeightSyncExtension")
    engine.collective_rpc("srl_join", args=("broadcast", link.to_json(), "rollout-0", 2))
    engine.collective_rpc("srl_receive", args=(min_version,))   # -> [version] per worker

Each worker is a receiver rank of the trainer's weight transport, whichever it is (`shm`,
`broadcast`, `cuda_ipc`: one table, `weights/transport.py`). vLLM imports this module inside its
worker processes (`vllm_client.py` puts this package on their PYTHONPATH), so it imports little at
the top; its methods are prefixed `srl_` so that they never shadow the worker's own
(`update_weights`, `reload_weights` exist). Arguments cross a msgpack boundary without types, so
only names, numbers and JSON are passed: the tensors come from the shared-memory store or the
sender's group, never through the RPC.

Weights are loaded with `reload_weights(..., is_checkpoint_format=True)`: on the CPU build the
linear layers are prepacked oneDNN handles and `model.load_weights` fails; reload restores,
loads and re-packs them. The caller resets the prefix cache afterwards (KV blocks computed by the
old weights would be reused otherwise). A model with tied embeddings gets `lm_head.weight` from
the embedding, or vLLM would keep sampling from the old head. During a reload, vLLM
warns "<layer class>: Failed to load weights" for every layer the update holds nothing for and
puts the layer's own tensors back, which is what an update of the trained parameters wants for
the rotary cos/sin caches and a VLM's frozen vision tower: those lines are dropped from the
worker's log while one of our reloads runs (`KeptOwnTensors`), and every other line still shows.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import Tensor

EMBED_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
KEPT_OWN_TENSORS = ": Failed to load weights"  # after the layer's class name


class KeptOwnTensors(logging.Filter):
    """Drops vLLM's warning for a layer a reload held nothing for (it keeps its own tensors)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().endswith(KEPT_OWN_TENSORS)


def with_tied_head(named: Iterable[tuple[str, Tensor]], tied: bool) -> list[tuple[str, Tensor]]:
    """`named`, completed for a head tied to the embedding: `lm_head.weight` from the embedding
    (what the trainer sends), or the text embedding from `lm_head.weight` (what a safetensors
    file of a tied model keeps)."""
    items = list(named)
    if not tied:
        return items
    embed = next((tensor for name, tensor in items if name in EMBED_NAMES), None)
    head = next((tensor for name, tensor in items if name == "lm_head.weight"), None)
    if head is None and embed is not None:
        items.append(("lm_head.weight", embed))
    elif embed is None and head is not None:  # under the model's own name: Qwen3-VL's vLLM maps no bare `model.`
        vision_language = any(name.startswith("model.language_model.") for name, _ in items)
        items.append((EMBED_NAMES[1] if vision_language else EMBED_NAMES[0], head))
    return items


class WeightSyncExtension:
    """Methods vLLM adds to its worker class (`self` is the worker: `reload_weights`, `rank`,
    `device`, `model_runner` are its own)."""

    def srl_join(self, transport: str, link: str, group: str, world_size: int) -> None:
        """Join the trainer's `transport` as receiver rank 1 + this worker's rank of `group`
        (`link`: a `weights.transport.Link` as JSON); a receiver joined before is closed."""
        from stream_rlhf.weights.transport import TRANSPORTS, Link

        self.srl_close()
        self._srl_receiver = TRANSPORTS[transport].join(Link.from_json(link), group, 1 + self.rank, world_size,
                                                        torch.device(self.device))

    def srl_receive(self, min_version: int) -> int:
        """Receive the newest version (at least `min_version`) from the joined transport and load
        it; returns its version."""
        receiver = getattr(self, "_srl_receiver", None)
        if receiver is None:
            raise RuntimeError(f"srl_receive({min_version}): no weight transport joined (srl_join first)")
        received = receiver.receive(min_version)
        if received is None:
            raise RuntimeError(f"srl_receive: no weights of version >= {min_version} in {receiver!r}")
        version, named = received
        self._srl_reload(named)
        return version

    def srl_close(self) -> None:
        receiver = getattr(self, "_srl_receiver", None)
        if receiver is not None:
            receiver.close()
            self._srl_receiver = None

    def _srl_reload(self, named: Iterable[tuple[str, Tensor]]) -> None:
        config = self.model_runner.model_config.hf_config
        # a text model's own config; Qwen2-VL's text config has none, its top config does
        tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", config.tie_word_embeddings))
        reload_log, kept = logging.getLogger(RELOAD_LOGGER), KeptOwnTensors()
        reload_log.addFilter(kept)
        try:
            self.reload_weights(weights_iterator=iter(with_tied_head(named, tied)), is_checkpoint_format=True)
        finally:
            reload_log.removeFilter(kept)
