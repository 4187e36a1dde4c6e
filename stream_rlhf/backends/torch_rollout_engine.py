"""The rollout stage's torch engine (`rollout.backend: torch`): our KV-cache sampler over the
policy model in the rollout process, on its rank's device; speculative with Medusa heads when
`rollout.medusa` is enabled (`speculation.py`); over static caches and CUDA graphs as
`rollout.decode` says (`static_decode.py`).

    engine = TorchRolloutEngine(job, weights, images, ctx)
    out = engine.generate(batch, prompts, params)   # Generated (backends/rollout_engine.py)
    sampler = engine.turn_sampler(batch, params, slots, capacity)   # multi-turn episodes: TorchTurnSampler
    engine.join_turns(sampler, batch)   # another mini-batch's episodes join: the newest weights (episode_sampler.py)
    features = engine.encode_images(pixel_values, grid_thw)   # an observation's images: the policy's own tower

Before each mini-batch it loads the newest policy version (`RolloutWeights.refresh_model`): every
token of the mini-batch is sampled by that version (episodes of several mini-batches in flight: a
joining mini-batch loads it, and each token records the version that sampled it). With
`precision: bf16` it samples under bf16 autocast (`backends/precision.py`); logits and log-probs stay fp32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor
from transformers import PreTrainedTokenizerBase

from stream_rlhf.backends.core_lending import govern
from stream_rlhf.backends.decode_attention import use_decode_attention
from stream_rlhf.backends.episode_sampler import CUDA_FREE_POSITIONS, TorchTurnSampler
from stream_rlhf.backends.kernel_warm_up import warm_up_sampling_kernel
from stream_rlhf.backends.precision import autocast
from stream_rlhf.backends.rollout_engine import Generated
from stream_rlhf.backends.speculation import Speculation
from stream_rlhf.backends.static_decode import static_decoder
from stream_rlhf.backends.static_sampler import sample
from stream_rlhf.backends.torch_rollout import SamplingParams
from stream_rlhf.backends.turn_stop import TurnStop
from stream_rlhf.data.tokenizer import load_tokenizer
from stream_rlhf.models.checkpoint import load_policy
from stream_rlhf.models.vision_language import encode_images, is_vision_language_model
from stream_rlhf.seeding import rollout_seed, seeded_generator
from stream_rlhf.stage import Batch, StageContext
from stream_rlhf.telemetry.cuda_allocator import allocator_counter

if TYPE_CHECKING:  # the rollout stage's own objects, passed in: stages/ is above the engines
    from stream_rlhf.stages.images import ImageInputs
    from stream_rlhf.stages.job_context import JobContext
    from stream_rlhf.stages.weight_sync import RolloutWeights


class TorchRolloutEngine:
    def __init__(self, job: JobContext, weights: RolloutWeights, images: ImageInputs, ctx: StageContext):
        self.job = job
        self.weights = weights
        self.images = images
        self.device = ctx.group.device
        self.model = load_policy(job.checkpoint).eval().to(self.device)
        use_decode_attention(self.model)
        warm_up_sampling_kernel(self.model)  # compiles here, not in the first mini-batch
        govern(self.model)  # core lending, when the launcher turned it on for this stage
        self.policy_version = 0
        self.tokenizer: PreTrainedTokenizerBase | None = None
        """Loaded for the first turn sampler with stop strings."""
        weights.join_model(self.model)
        self.static = static_decoder(job.config.rollout.decode, self.device, self.model, ctx.log)
        medusa = job.config.rollout.medusa.enabled
        self.speculation = Speculation(job, self.model, ctx.log, self.static) if medusa else None

    def generate(self, batch: Batch, prompts: list[Tensor], params: SamplingParams) -> Generated:
        self.policy_version = self.weights.refresh_model(self.model, self.policy_version)
        generator = seeded_generator(*rollout_seed(self.job.config.seed, batch.iteration, batch.minibatch),
                                     device=self.device)
        info = {}
        with autocast(self.device, self.job.config.precision):
            if self.speculation is not None:
                gen, info = self.speculation.generate(self.model, prompts, params, generator, self.policy_version)
            else:
                gen = sample(self.model, prompts, params, generator, self.images.of(batch.tensors), self.static)
        allocator_counter(self.device)
        return Generated(gen, self.policy_version, info)

    def turn_sampler(self, batch: Batch, params: SamplingParams, slots: int, capacity: int) -> TorchTurnSampler:
        """The TurnSampler of multi-turn episodes (`envs/turns.py`): `slots` episodes at once, a slot cache
        of `capacity` positions each. The newest policy version, loaded now, samples every turn until
        `join_turns` loads a newer one; each turn draws from a stream seeded by its episode's name and index
        (`seeding.TurnSeeds`, as on vLLM), so an episode's tokens do not depend on its company. Medusa heads
        are not used for turns. One sampler at a time, and no `generate` while it is open: with a static
        decoder they share its bucket's cache."""
        self.policy_version = self.weights.refresh_model(self.model, self.policy_version)
        seed_parts = rollout_seed(self.job.config.seed, batch.iteration, batch.minibatch)
        precision = self.job.config.precision
        stop_text = TurnStop(params.stop_strings, self._decode) if params.stop_strings else None
        return TorchTurnSampler(self.model, slots, capacity, params, seed_parts, self.policy_version,
                                self.static, precision=lambda: autocast(self.device, precision),
                                free_positions=CUDA_FREE_POSITIONS if self.device.type == "cuda" else 0,
                                stop_text=stop_text)

    def _decode(self, ids: list[int]) -> str:
        """Text of `ids` without special tokens, as an environment reads a turn (for env.stop_strings)."""
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.job.checkpoint)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def join_turns(self, sampler: TorchTurnSampler, batch: Batch) -> None:
        """Before `batch`'s episodes join: the newest weights, loaded between two decode steps. The
        turns in progress go on with them (the slots keep the KV their earlier tokens made), and
        every token records its version."""
        self.policy_version = self.weights.refresh_model(self.model, self.policy_version)
        sampler.policy_version = self.policy_version

    def encode_images(self, pixel_values: Tensor, grid_thw: Tensor) -> list[Tensor]:
        """An observation's images through the policy's own vision tower (frozen: the same weights
        as the vision stage's, in the same precision), counted as `images_encoded` of this stage."""
        if not is_vision_language_model(self.model):
            raise ValueError("the policy is a text model: it takes no images")
        features = encode_images(self.model, pixel_values, grid_thw)  # no autocast, as the vision stage's
        self.images.counts.add(images_encoded=len(grid_thw), encoder_calls=1)
        return features

    def close(self) -> None:
        """Nothing outside this process to release."""
