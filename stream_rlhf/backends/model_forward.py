"""The module a torch train engine runs every forward through, and the root FSDP2 shards (so that
the embedding and the heads are gathered around it: the fused log-prob kernel reads the LM head's
weight directly, not through the model's own forward).

    forward = ModelForward(model, sharded=False)
    logp, entropy = forward(sequences, None, temperature=0.7, with_entropy=True)   # per sequence
    logp, _ = forward(sequences, None, 0.7, prompt_lens=lens, responses=R)        # (N, R) at the responses
"""

from __future__ import annotations

from torch import Tensor, nn

from stream_rlhf.models.packing import packed_forward, sequence_logprobs
from stream_rlhf.models.response_outputs import response_logprobs, response_outputs
from stream_rlhf.samples import SampleImages


class ModelForward(nn.Module):
    """The model's forward passes as one module's forward, the root FSDP2 shards: a causal LM's
    token log-probs (and entropies) through the fused kernel, which reads the LM head's weight
    directly (not through the model's own forward), or a value model's per-position outputs."""

    def __init__(self, model: nn.Module, sharded: bool):
        super().__init__()
        self.model = model
        self.sharded = sharded

    def forward(self, sequences: list[Tensor], images: list[SampleImages] | None, temperature: float | None = None,
                with_entropy: bool = False, prompt_lens: Tensor | None = None,
                responses: int | None = None) -> tuple[list[Tensor] | Tensor, list[Tensor] | Tensor | None]:
        """temperature None: (per-position outputs (L_i, ...), None); else sequence_logprobs. With
        `prompt_lens` the samples of a prompt share its forward (`models/packing.py`). With
        `responses` = W (and `prompt_lens`): each output is one (N, W, ...) tensor of the positions
        predicting the response tokens instead (`response_outputs`, `response_logprobs`): a
        gather, not an operation per sequence. Sharded, each output is a tensor of its own, not a
        view into the packed rows: FSDP2 hooks the backward of a module's outputs, and warns of
        views (B x L floats: cheap to copy)."""
        if responses is not None:
            if temperature is None:
                return response_outputs(self.model, sequences, prompt_lens, responses, images=images), None
            return response_logprobs(self.model, sequences, temperature, prompt_lens, responses,
                                     with_entropy=with_entropy, images=images)
        if temperature is None:
            return self._own(packed_forward(self.model, sequences, images=images, prompt_lens=prompt_lens)), None
        logp, entropy = sequence_logprobs(self.model, sequences, temperature, with_entropy=with_entropy, images=images,
                                          prompt_lens=prompt_lens)
        return self._own(logp), self._own(entropy) if entropy is not None else None

    def _own(self, tensors: list[Tensor]) -> list[Tensor]:
        return [t.clone() for t in tensors] if self.sharded else tensors
