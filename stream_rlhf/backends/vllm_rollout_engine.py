"""The rollout stage's vLLM engine (`rollout.backend: vllm`): one engine process per instance.

    engine = VllmRolloutEngine(job, weights, images, ctx)
    out = engine.generate(batch, prompts, params)   # Generated (backends/rollout_engine.py)
    sampler = engine.turn_sampler(batch, params, slots, capacity)   # multi-turn episodes (vllm_turns.py)
    engine.join_turns(sampler, batch)               # another mini-batch's episodes join them
    engine.close()

Weight updates (`weights.update`):
    drain       before a mini-batch, the engine loads the newest version; every token of the
                mini-batch is sampled by it.
    in_flight   also while a mini-batch generates: the update is applied between engine steps,
                requests keep their KV cache, and `token_versions` records which version sampled
                each token. The handle's policy_version is the oldest version in it, so the
                staleness bound holds for every token. Multi-turn episodes take an update
                at a turn boundary instead: new turns wait for the running ones to end
                (each turn is sampled by one version), and prefix caching stays on.
Episodes of several mini-batches share the engine (`env.minibatches_in_flight`): each one that
joins loads the newest version at the next turn boundary, under either policy, so the later turns
of the episodes already running take it too (each turn records its version).

With `rollout.vllm.sleep`, the engine sleeps after an iteration's last mini-batch (releasing its
KV cache and weights while training runs on the same device) and wakes for the next one,
weights first, then the new version, then the KV cache (a no-op on CPU, where vLLM has no sleep
mode).

A vision-language model's prompts go with the image features of the input handle
(`stages/images.py`, as the torch backend reads them): vLLM takes them as image embeddings. So do
the images an episode's observations show, encoded in this process (`encode_images`); a turn may
hold data.max_images_per_prompt + env.max_observation_images of them.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from stream_rlhf.backends.rollout_engine import Generated
from stream_rlhf.backends.torch_rollout import SamplingParams
from stream_rlhf.backends.vllm_client import GenerateAbandoned, VllmClient
from stream_rlhf.backends.vllm_protocol import Update
from stream_rlhf.backends.vllm_rollout import VllmOptions
from stream_rlhf.backends.vllm_turns import VllmTurnSampler
from stream_rlhf.models.checkpoint import max_positions
from stream_rlhf.seeding import rollout_seed, seeded_generator
from stream_rlhf.stage import Batch, StageContext, StepAborted

if TYPE_CHECKING:  # the rollout stage's own objects, passed in: stages/ is above the engines
    from stream_rlhf.stages.images import ImageInputs
    from stream_rlhf.stages.job_context import JobContext
    from stream_rlhf.stages.weight_sync import RolloutWeights


def engine_options(job: JobContext, max_model_len: int) -> VllmOptions:
    cfg = job.config.rollout.vllm
    return VllmOptions(
        max_model_len=cfg.max_model_len or max_model_len,
        kv_cache_gb=cfg.kv_cache_gb,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        tensor_parallel_size=cfg.tensor_parallel_size,
        enforce_eager=cfg.enforce_eager,
        # in-flight updates between engine steps would leave stale cached blocks in use; multi-turn
        # episodes take them only at turn boundaries, with nothing running (vllm_turns.py)
        prefix_caching=job.config.weights.update == "drain" or job.config.env is not None,
        max_num_seqs=cfg.max_num_seqs,
        cpu_cores=None if torch.cuda.is_available() else sorted(os.sched_getaffinity(0)),
        seed=job.config.seed,
        # an episode's turn holds its prompt's images and its observations'
        max_images_per_prompt=job.config.data.max_images_per_prompt + (
            job.config.env.max_observation_images if job.config.env is not None else 0),
        block_size=cfg.block_size,
    )


class VllmRolloutEngine:
    def __init__(self, job: JobContext, weights: RolloutWeights, images: ImageInputs, ctx: StageContext):
        self.job = job
        self.stopping: threading.Event = ctx.stopping
        self.weights = weights
        self.images = images
        cfg = job.config.rollout.vllm
        self.options = engine_options(job, max_positions(job.checkpoint))
        self.engine = VllmClient(job.checkpoint, self.options, python=cfg.python, start_timeout_s=cfg.start_timeout_s)
        weights.join_engine(self.engine)
        self.in_flight = job.config.weights.update == "in_flight"
        self.sleeping = False
        self.last_batch: Batch | None = None
        """The mini-batch whose episodes joined the open turn sampler last."""

    def generate(self, batch: Batch, prompts: list[Tensor], params: SamplingParams) -> Generated:
        """The responses, stamped with the oldest policy version that sampled a token of them."""
        self._refresh()
        generator = seeded_generator(*rollout_seed(self.job.config.seed, batch.iteration, batch.minibatch))
        seeds = torch.randint(0, 2**62, (len(prompts),), generator=generator).tolist()
        try:
            gen = self.engine.generate(prompts, params, seeds, self._in_flight_update if self.in_flight else None,
                                       images=self.images.of(batch.tensors), stopping=self.stopping)
        except GenerateAbandoned as exc:
            raise StepAborted(str(exc)) from None
        self._after(batch)
        oldest = min((int(v.min()) for v in gen.token_versions if len(v)), default=self.engine.version)
        return Generated(gen, oldest, token_versions=gen.token_versions if self.in_flight else None)

    def turn_sampler(self, batch: Batch, params: SamplingParams, slots: int, capacity: int) -> VllmTurnSampler:
        """The sampler of a mini-batch's multi-turn episodes (`vllm_turns.py`), and of those of the
        mini-batches that `join_turns` while it is open, with the newest weights loaded first;
        in-flight updates land at turn boundaries. `slots` and `capacity` are the torch engine's
        (vLLM's own scheduler and rollout.vllm.max_model_len hold these). Once it closes, the
        engine sleeps if the last mini-batch begun was an iteration's last (`rollout.vllm.sleep`),
        and the stage counts its turns' context tokens and prefix-cache hits."""
        self._refresh()
        self.last_batch = batch
        seed_parts = rollout_seed(self.job.config.seed, batch.iteration, batch.minibatch)
        sampler = VllmTurnSampler(self.engine, params, seed_parts, self.options.max_model_len,
                                  self._in_flight_update if self.in_flight else None, self.stopping,
                                  on_close=lambda: self._turns_closed(sampler))
        return sampler

    def join_turns(self, sampler: VllmTurnSampler, batch: Batch) -> None:
        """`batch`'s episodes join the open sampler: vLLM's scheduler batches their turns with
        those in flight. The newest weights are loaded at the next turn boundary, before their
        first turn (new turns wait for the running ones to end meanwhile)."""
        self.last_batch = batch
        sampler.join(self.weights.engine_update(self.engine.version))

    def encode_images(self, pixel_values: Tensor, grid_thw: Tensor) -> list[Tensor]:
        """An observation's images through a frozen copy of the policy's vision tower that this
        rollout process loads at the first such image (vLLM's own tower, in the engine process, is
        never run: every turn sends vLLM its episode's features as image embeddings); counted as
        `images_encoded` of this stage. ValueError for a text model."""
        return self.images.encode(pixel_values, grid_thw)

    def _turns_closed(self, sampler: VllmTurnSampler) -> None:
        """Count the closed sampler's context tokens sent and those its prefix cache held
        (`turn_context_tokens`, `turn_cached_tokens`), then sleep if the last mini-batch was an
        iteration's last."""
        self.images.counts.add(turn_context_tokens=sampler.context_tokens, turn_cached_tokens=sampler.cached_tokens)
        self._after(self.last_batch)

    def _refresh(self) -> None:
        """Before a mini-batch: wake the engine if it sleeps, and load the newest version."""
        update = self.weights.engine_update(self.engine.version)
        if self.sleeping:
            self.engine.wake_up(update)
            self.sleeping = False
        elif update is not None:
            self.engine.update(update.version, update.method, *update.args)

    def _after(self, batch: Batch) -> None:
        """After a mini-batch: sleep after the iteration's last one (`rollout.vllm.sleep`)."""
        if self.job.config.rollout.vllm.sleep and batch.minibatch == self.job.config.rollout_batch.minibatches - 1:
            self.engine.sleep()
            self.sleeping = True

    def _in_flight_update(self) -> Update | None:
        return self.weights.engine_update(self.engine.version)

    def close(self) -> None:
        self.engine.close()
