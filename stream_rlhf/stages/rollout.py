"""Rollout: samples responses from the current policy through a rollout engine
(`backends/rollout_engine.py`): our torch KV-cache sampler (`backends/torch_rollout_engine.py`) or
vLLM (`backends/vllm_rollout_engine.py`), chosen by `rollout.backend`.

Before each mini-batch the engine loads the newest actor weights the trainer published (with
`weights.update: in_flight` vLLM also takes them between engine steps), and every output carries
the `policy_version` that generated it along with the behaviour log-probs of the sampled tokens;
the engines give the same fields. A vision-language model reads the image features of its input
handle (the vision stage's; `stages/images.py`). With `rollout.medusa` enabled, decoding is
speculative with Medusa heads where that is faster (`backends/speculation.py`). Every output is kept on disk
until a checkpoint covers its iteration (`stages/generated_store.py`), and a mini-batch found
there (a resumed run, a redelivery after a crash) is published again rather than generated.
With `env`, each sample is a multi-turn episode in that environment (`stages/episodes.py`); under
`env.schedule: stream` the stage works on `env.minibatches_in_flight` mini-batches at once
(`begin` / `advance`: `Stage.inputs_in_flight`), so their episodes decode together while others
wait for their tools.
"""

from __future__ import annotations

import torch

from stream_rlhf.backends.rollout_engine import ROLLOUT_ENGINES, RolloutEngine
from stream_rlhf.backends.torch_rollout import SamplingParams
from stream_rlhf.config import import_dotted
from stream_rlhf.data.tokenizer import load_tokenizer, stop_token_ids
from stream_rlhf.samples import ragged, unragged
from stream_rlhf.stage import Batch, Output, Stage, StageContext
from stream_rlhf.stages.episodes import EpisodeRollout
from stream_rlhf.stages.generated_store import GeneratedStore
from stream_rlhf.stages.images import ImageInputs
from stream_rlhf.stages.job_context import JobContext, stage_counts
from stream_rlhf.stages.topics import REWARD_KWARGS, topic_output
from stream_rlhf.stages.weight_sync import RolloutWeights
from stream_rlhf.telemetry.episodes import record_episodes


class RolloutStage(Stage):
    def __init__(self, job: JobContext):
        self.job = job

    def setup(self, ctx: StageContext) -> None:
        super().setup(ctx)
        cfg = self.job.config.rollout
        tokenizer = load_tokenizer(self.job.checkpoint)
        stop_ids = stop_token_ids(tokenizer, cfg.stop, self.job.config.data.chat_template, self.job.checkpoint)
        env = self.job.config.env
        self.params = SamplingParams(cfg.temperature, cfg.top_p, cfg.max_new_tokens, stop_ids, tokenizer.pad_token_id,
                                     tuple(env.stop_strings) if env is not None else ())
        # generated = trained + dropped + in flight at stop, in the summary; per process on disk,
        # so a restarted instance adds to the count
        self.counts = stage_counts(self.job, ctx)
        self.weights = RolloutWeights(self.job, ctx.instance_id)
        self.images = ImageInputs(self.job, self.counts, ctx.group.device)
        engine_class = import_dotted(ROLLOUT_ENGINES[cfg.backend], "rollout.backend")
        self.engine: RolloutEngine = engine_class(self.job, self.weights, self.images, ctx)
        self.episodes = (None if env is None
                         else EpisodeRollout(self.job, tokenizer, self.params, self.engine, self.counts, ctx.log))
        self.generated = GeneratedStore(self.job.run_dir) if self.job.config.checkpoint.keep_generated else None
        self.replayed: list[tuple[Batch, list[Output]]] = []
        """Mini-batches begun that the generated store held: handed back by the next `advance`."""

    def on_weights(self, version: int) -> None:
        self.weights.announced = max(self.weights.announced, version)

    def inputs_in_flight(self) -> int:
        """Mini-batches worked on at once: env.minibatches_in_flight for episodes under `stream`
        (`stages/episodes.py`), else one."""
        return self.episodes.in_flight if self.episodes is not None else 1

    def step(self, batch: Batch | None) -> list[Output]:
        if (kept := self._kept(batch)) is not None:
            return [kept]
        prompts = unragged(batch.tensors, "prompt_ids")
        if self.episodes is not None:
            generated = self.episodes.generate(batch, prompts, self.images.of(batch.tensors))
        else:
            generated = self._generate(batch, prompts)
        return [self._output(batch, *generated)]

    def begin(self, batch: Batch) -> None:
        """A mini-batch's episodes join those in flight (inputs_in_flight() > 1)."""
        if (kept := self._kept(batch)) is not None:
            self.replayed.append((batch, [kept]))
            return
        self.episodes.begin(batch, unragged(batch.tensors, "prompt_ids"), self.images.of(batch.tensors))

    def advance(self) -> list[tuple[Batch, list[Output]]]:
        """A step of the episodes in flight; the mini-batches that ended, with their outputs."""
        ended, self.replayed = self.replayed, []
        if self.episodes.busy:
            ended += [(batch, [self._output(batch, tensors, version, extra)])
                      for batch, tensors, version, extra in self.episodes.advance()]
        return ended

    def _kept(self, batch: Batch) -> Output | None:
        """The mini-batch's output as generated before a stop, if the generated store holds it."""
        if self.generated is None or (kept := self.generated.load(batch.iteration, batch.minibatch)) is None:
            return None
        self.counts.add(replayed=kept.num_samples)  # generated before a stop: trained, not generated again
        return kept

    def _output(self, batch: Batch, tensors: dict[str, torch.Tensor], policy_version: int, extra: dict) -> Output:
        """The rollout handle of `batch`'s samples, kept in the generated store and counted."""
        samples = len(tensors["prompt_lens"])
        if not self.job.vision_language:  # else the image handle the broker joins with this one carries them
            tensors["group_ids"] = batch.tensors["group_ids"]
        output = topic_output("rollout", tensors, samples, batch.iteration, batch.minibatch, policy_version,
                              metadata={"references": batch.metadata["references"],
                                        REWARD_KWARGS: batch.metadata[REWARD_KWARGS], **extra})
        # counted before it is kept: a rollout killed in between has counted a mini-batch that its
        # successor generates (and counts) again, never kept one that nobody counted (replayed
        # mini-batches are not counted as generated)
        record_episodes(self.counts, output.metadata, batch.iteration, batch.minibatch, generated=samples)
        if self.generated is not None:
            self.generated.save(output)
        return output

    def _generate(self, batch: Batch, prompts: list[torch.Tensor]) -> tuple[dict[str, torch.Tensor], int, dict]:
        """One response per prompt: the handle's sequences, prompt lengths and log-probs (and
        per-token versions when weights changed during generation), the policy version, and the
        engine's metadata with "finished": how many responses ended at a stop token."""
        out = self.engine.generate(batch, prompts, self.params)
        gen = out.generation
        tensors = {**ragged("sequences", [torch.cat([p, r]) for p, r in zip(prompts, gen.response_ids)]),
                   **ragged("behavior_logp", gen.response_logp),
                   "prompt_lens": torch.tensor([len(p) for p in prompts], dtype=torch.int32),
                   "truncated": torch.tensor([reason == "length" for reason in gen.finish_reasons])}
        if out.token_versions is not None:
            tensors.update(ragged("token_versions", out.token_versions))  # (R_i,) version per token
        finished = sum(reason == "stop" for reason in gen.finish_reasons)
        return tensors, out.policy_version, {"finished": finished, **out.metadata}

    def close(self) -> None:
        if self.episodes is not None:
            self.episodes.close()
        self.engine.close()
        self.weights.close()
