"""The rollout-engine seam: what the rollout stage asks of a generation backend.

    engine = ROLLOUT_ENGINES[cfg.rollout.backend] -> import_dotted(...)(job, weights, images, ctx)
    out = engine.generate(batch, prompts, params)     # Generated: responses, version, metadata
    sampler = engine.turn_sampler(batch, params, slots, capacity)   # multi-turn episodes (envs/turns.py)
    engine.join_turns(sampler, batch)                 # the next mini-batch's episodes join it
    features = engine.encode_images(pixel_values, grid_thw)   # an observation's images (env jobs)
    engine.close()

Each engine keeps its own weights current before it generates (`stages/weight_sync.py`:
RolloutWeights), so a response carries the policy version that sampled it; how it sleeps, wakes
and takes weight updates between or during generation is its own business. The rollout stage
(`stages/rollout.py`) turns what it returns into the rollout handle, the same fields whatever the
engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor

from stream_rlhf.backends.torch_rollout import Generation, SamplingParams
from stream_rlhf.envs.turns import TurnSampler
from stream_rlhf.stage import Batch

ROLLOUT_ENGINES = {
    "torch": "stream_rlhf.backends.torch_rollout_engine:TorchRolloutEngine",
    "vllm": "stream_rlhf.backends.vllm_rollout_engine:VllmRolloutEngine",
}
"""`rollout.backend` -> the engine class, loaded only when chosen (vLLM's client stays unimported)."""


@dataclass(frozen=True)
class Generated:
    """One mini-batch's responses from a rollout engine."""

    generation: Generation
    policy_version: int
    """The oldest policy version that sampled a token of these responses."""
    metadata: dict[str, int | str] = field(default_factory=dict)
    """Handle metadata the engine adds (speculative decoding statistics, ...)."""
    token_versions: list[Tensor] | None = None
    """(R_i,) the version that sampled each response token, when weights changed during
    generation (vLLM's in-flight updates); None when one version sampled every token."""


class RolloutEngine(Protocol):
    def generate(self, batch: Batch, prompts: list[Tensor], params: SamplingParams) -> Generated:
        """Sample one response per prompt of `batch`, with the newest weights it can load first."""

    def turn_sampler(self, batch: Batch, params: SamplingParams, slots: int, capacity: int) -> TurnSampler:
        """A sampler of policy turns (`env` jobs: `envs/episode_loop.py`) for `batch`'s episodes, and
        for those of later mini-batches that `join_turns` while it is open: `slots` episodes at
        once, `capacity` positions each (the torch engine's slot cache). The newest weights it can
        load are loaded first; the caller closes it once its episodes have all ended."""

    def join_turns(self, sampler: TurnSampler, batch: Batch) -> None:
        """Before `batch`'s episodes join the open `sampler` (`env.minibatches_in_flight`): load the
        newest weights (every token sampled after records its version)."""

    def encode_images(self, pixel_values: Tensor, grid_thw: Tensor) -> list[Tensor]:
        """Image features, one (tokens_i, W) per image, of the images an episode's observation shows
        (`envs/observation_images.py`); ValueError naming the setting when the engine takes none."""

    def close(self) -> None:
        """Release the engine (its process, its device memory)."""
