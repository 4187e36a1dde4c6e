"""The RL job config: what `configs/text_ppo.yaml` and `configs/text_grpo.yaml` hold.

Glossary (the words the code and the metrics use):
    iteration       one rollout batch: `rollout_batch.minibatches` mini-batches of prompts, generated,
                    scored and then trained on together.
    mini-batch      the unit that flows between stages as one broker handle.
    policy_version  the actor weights: v0 is the starting checkpoint; training iteration i publishes
                    v(i+1). Every sample carries the version that generated it.
    staleness       trainer version minus the sample's policy_version when it is trained on;
                    never more than `overlap_depth`.
    optimizer step  one gradient update; `algorithm.ppo_epochs * algorithm.train_minibatches` of
                    them make one training iteration.

Every section is a frozen dataclass beside the component it configures (`models/model_config.py`,
`data/task_config.py`, `backends/rollout_config.py`, `algos/config.py`, `rl/reward_parts_config.py`,
`weights/sync_config.py`, `launch/placement.py`, ...); this file holds the job's own keys and the
checks that span sections; `rl/stage_kinds.py` the stages a job may have and what kind each is.
Unknown keys, wrong types, values outside a field's declared constraint and impossible combinations
fail in `stream_rlhf.config.build` before any process starts, naming the dotted key and value; every
key is listed in docs/config.md.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Annotated, Literal

from msgspec import Meta

from stream_rlhf.algos.config import AlgorithmConfig
from stream_rlhf.backends.megatron.config import check_model
from stream_rlhf.backends.optimizer_config import OptimizerConfig
from stream_rlhf.backends.precision import Precision
from stream_rlhf.backends.rollout_config import RolloutConfig
from stream_rlhf.broker.control.topology import BrokerConfig
from stream_rlhf.config import ConfigError, check_fields
from stream_rlhf.data.task_config import DataConfig, TaskConfig
from stream_rlhf.envs.config import EnvConfig
from stream_rlhf.launch.placement import AUTO, PlacementConfig, StagePlacement, device_group_of
from stream_rlhf.launch.ray_config import RayConfig
from stream_rlhf.models.lora_config import ALL_PROJECTIONS
from stream_rlhf.models.model_config import ModelConfig, VisionConfig
from stream_rlhf.resume.config import CheckpointConfig
from stream_rlhf.rl.reward_parts_config import CriticConfig, RewardConfig
from stream_rlhf.rl.stage_kinds import STAGE_KINDS, stages_where
from stream_rlhf.telemetry.sample_log import SampleLogConfig
from stream_rlhf.weights.offload_config import TRAINING_STATE
from stream_rlhf.weights.sync_config import WeightSyncConfig

DEFAULT_RESTARTS = 2
"""Restarts of a crashed instance of a restartable stage that `restarts` leaves out."""
CRITIC_OPTIMIZER = CriticConfig()
"""The critic's settings when `critic` is left out."""
log = logging.getLogger("stream_rlhf")
IGNORED_ALGORITHM_KEYS = {
    "gae": ("group_std",),
    "grpo": ("gamma", "lam", "value_clip"),
    "rloo": ("gamma", "lam", "value_clip", "group_std"),
    "reinforce_pp": ("lam", "value_clip", "group_std"),
}
"""The `algorithm` keys each advantage estimator never reads (`algos/advantages.py`); those without a
critic ignore `critic.*` and the critic stages' placement too. Setting one is a config error."""
SHARDED_STAYS = ("{stage} has ranks={ranks} on the torch backend on CUDA: its model is sharded over them (FSDP2), "
                 "and moving a sharded model off the device is not built yet (give it one rank, backend: "
                 "megatron, or no offload)")
"""Why a sharded torch trainer on CUDA takes no offload policy and joins no device group."""


@dataclass(frozen=True)
class RolloutBatchConfig:
    """How many prompts an iteration generates for, in how many mini-batches."""

    prompts_per_minibatch: Annotated[int, Meta(ge=1)] = 32
    """Prompts in each mini-batch (the unit that flows between stages); it holds
    prompts_per_minibatch * samples_per_prompt samples."""
    minibatches: Annotated[int, Meta(ge=1)] = 2
    """Mini-batches per iteration (per rollout batch)."""
    samples_per_prompt: Annotated[int, Meta(ge=1)] = 1
    """Responses per prompt; GRPO and RLOO need >= 2 (they normalise within a prompt's group)."""

    def __post_init__(self) -> None:
        check_fields(self)

    @property
    def samples_per_minibatch(self) -> int:
        return self.prompts_per_minibatch * self.samples_per_prompt


@dataclass(frozen=True)
class RLJobConfig:
    """An RL job (`stream-rlhf run configs/text_ppo.yaml`): the top level of its YAML file."""

    name: str
    """The run's name: its folder under `runs_dir` (no "/"), which holds metrics, summary, trace,
    checkpoints and logs."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """The advantage estimator, PPO's clipping and epochs, and the KL penalty."""
    schedule: Literal["stream", "sync"] = "stream"
    """`stream`: every stage works as soon as its input is there, rollout up to `overlap_depth`
    versions ahead; `sync`: phase by phase (all of an iteration's rollout, then its forwards, then
    training), on-policy (overlap_depth 0), the baseline."""
    overlap_depth: Annotated[int, Meta(ge=0)] = 1
    """How many policy versions rollout may run ahead of training (0: on-policy)."""
    iterations: Annotated[int, Meta(ge=1)] = 20
    """Training iterations of the run: each generates, scores and trains on one rollout batch, and
    publishes one policy version."""
    rollout_batch: RolloutBatchConfig = field(default_factory=RolloutBatchConfig)
    """The size of an iteration: prompts per mini-batch, mini-batches, responses per prompt."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy: a checkpoint folder, or the embedded tiny model and its warm start."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The synthetic task whose prompts and references the run uses (unless `data` gives a dataset)."""
    data: DataConfig = field(default_factory=DataConfig)
    """A JSONL prompt dataset in place of the task's prompts."""
    vision: VisionConfig = field(default_factory=VisionConfig)
    """The vision stage of a vision-language model (ignored for text models)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation: backend, instances, sampling, speculative decoding."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """What scores a response: a rule function, a reward model, process rewards."""
    env: EnvConfig | None = None
    """Multi-turn / tool-using episodes: the environment each sample runs in and the engine's
    limits on episodes (`envs/config.py`, docs/environments.md); None: one response per prompt."""
    actor: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The actor's (policy's) optimizer, and LoRA adapters if it trains those only."""
    critic: CriticConfig = field(default_factory=lambda: CRITIC_OPTIMIZER)
    """The critic's optimizer, initialisation and warm-up (gae only)."""
    placement: PlacementConfig | Literal["auto"] = field(default_factory=PlacementConfig)
    """Which cores and devices each stage's ranks run on, and which stages share a device;
    `auto` (the same as leaving it out): every key at its default, mode, with_rollout and
    device_groups chosen by the driver for the workload (`planner/auto_placement.py`)."""
    weights: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """How rollout gets each new policy version from actor_train."""
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    """The broker's settings (queue capacity, heartbeats; its address when stages join by hand)."""
    runs_dir: str = "runs"
    """The folder that holds the run folders (runs/<name>/)."""
    seed: int = 0
    """Seed of sampling, of the dataset's order and of the trainers' shuffles: each stage derives
    its generators from it and the iteration (and mini-batch), so a run is reproducible whatever
    the timing."""
    timeout_s: Annotated[float, Meta(gt=0)] = 900.0
    """The run fails if it has not finished by then (seconds); a rank also waits at most this long
    in a collective."""
    restarts: dict[str, int] = field(default_factory=dict)
    """Stage -> how often the launcher restarts a crashed instance (stateless stages only: rollout
    and the forwards; redelivery gives the new instance the unfinished mini-batches). A stateless
    stage left out restarts up to DEFAULT_RESTARTS = 2 times (rollout not with weights.transport
    cuda_ipc: a restarted instance rejoins shm and broadcast only); 0 turns it off. A crash no
    restart covers resumes the run (`checkpoint.recoveries`)."""
    precision: Precision = "auto"
    """Compute precision of the train and forward engines (torch and megatron) and of the torch
    sampler: `fp32`, `bf16` mixed precision (forwards under bf16 autocast; weights, gradients,
    optimizer state and the LM head's log-probs stay fp32: `backends/precision.py`), or `auto`:
    bf16 on a CUDA device, fp32 on the CPU. vLLM runs in its own dtype."""
    trace: bool = True
    """Record every stage step, wait, payload fetch, weight publish and load and checkpoint save, and
    the broker's queue depths, in runs/<name>/trace.json (Perfetto / chrome://tracing format,
    `telemetry/trace.py`); summary.json's `trace` holds the figures from it. false: no trace."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """When the run saves its state for `stream-rlhf run --resume` (`resume/config.py`)."""
    samples_log: SampleLogConfig = field(default_factory=SampleLogConfig)
    """How many samples of each mini-batch go to runs/<name>/samples.jsonl (`telemetry/sample_log.py`)."""
    launcher: Literal["local", "ray"] = "local"
    """What carries out the job plan: `local` processes on this machine, or `ray` actors in
    placement groups (`launch/ray_job.py`, the `ray` extra; its settings in `ray`)."""
    ray: RayConfig = field(default_factory=RayConfig)
    """Where `launcher: ray` finds its cluster and how it places the ranks (`launch/ray_config.py`)."""

    def __post_init__(self) -> None:
        check_fields(self)
        # sampling settings left unset come from the model folder, the same in every process
        object.__setattr__(self, "rollout", self.rollout.with_generation_defaults(self.model.path))
        if self.placement == AUTO:
            object.__setattr__(self, "placement", PlacementConfig())
        if not self.name or "/" in self.name:
            raise ConfigError(f"name={self.name!r}: a non-empty folder name")
        if self.schedule == "sync" and self.overlap_depth != 0:
            raise ConfigError(f"overlap_depth={self.overlap_depth}: schedule=sync is on-policy, needs 0")
        if self.algorithm.sampler_correction and self.overlap_depth != 0:
            raise ConfigError(f"algorithm.sampler_correction=true: overlap_depth={self.overlap_depth} weights every "
                              "token by proximal / behaviour already (decoupled PPO)")
        grouped = self.algorithm.advantage in ("grpo", "rloo")
        if grouped and self.rollout_batch.samples_per_prompt < 2:
            raise ConfigError(
                f"rollout_batch.samples_per_prompt={self.rollout_batch.samples_per_prompt}: "
                f"algorithm.advantage={self.algorithm.advantage} needs >= 2 samples per prompt"
            )
        self._check_dynamic_sampling(grouped)
        self._check_lora_reference()
        samples = self.rollout_batch.samples_per_minibatch * self.rollout_batch.minibatches
        if self.algorithm.train_minibatches > samples:
            raise ConfigError(
                f"algorithm.train_minibatches={self.algorithm.train_minibatches}: more than the {samples} "
                "samples of an iteration"
            )

        image_task = self.task.name in ("shapes", "shapes_dialogue")
        if self.rollout.medusa.enabled and (self.model.tiny.vision is not None or image_task):
            raise ConfigError("rollout.medusa.enabled=true: speculative rollout is text-only for now")
        if self.rollout.decode == "graphs" and self.placement.device == "cpu":
            raise ConfigError("rollout.decode=graphs: CUDA graphs need placement.device cuda (or auto on a GPU)")
        if image_task and self.model.path is None and self.model.tiny.vision is None:
            raise ConfigError(f"task.name={self.task.name}: asks about images, needs a vision-language model "
                              "(model.tiny.vision, or a Qwen2-VL / Qwen3-VL model.path)")
        if self.weights.update == "in_flight" and self.rollout.backend != "vllm":
            raise ConfigError("weights.update=in_flight: needs rollout.backend=vllm (the torch backend updates "
                              "between mini-batches)")
        if self.weights.transport == "cuda_ipc" and self.restarts.get("rollout", 0):
            raise ConfigError(f"restarts.rollout={self.restarts['rollout']}: a restarted instance cannot rejoin "
                              "its weights.transport=cuda_ipc sender yet; use broadcast or shm")
        for stage, count in self.restarts.items():
            if stage not in STAGE_KINDS or not STAGE_KINDS[stage].restartable:
                raise ConfigError(f"restarts.{stage}={count}: only {', '.join(stages_where('restartable'))} can "
                                  "restart (the others hold state a restart would lose)")
            if count < 0:
                raise ConfigError(f"restarts.{stage}={count}: must be >= 0")
        self._check_stage_placements()
        self._check_device_groups()
        self._check_keys_the_algorithm_ignores()
        self._check_launcher()
        self._check_critic()
        self._check_reward_and_env()
        self._check_torch_trainer_keys()

    def _check_launcher(self) -> None:
        if self.launcher != "ray" and self.ray != RayConfig():
            raise ConfigError(f"ray: set, but launcher={self.launcher} never reads it (launcher: ray)")
        for stage in self.ray.stage_resources:
            if stage not in STAGE_KINDS and stage != "broker":
                raise ConfigError(f"ray.stage_resources.{stage}: not a stage ({', '.join(STAGE_KINDS)}) or broker")

    def _check_critic(self) -> None:
        """critic.init and critic.warmup_iterations need what they read; an actor learning faster
        than its critic is allowed but warned about (seed 004 saw PPO diverge with it)."""
        if not self.algorithm.uses_critic:
            return
        if self.critic.init == "reward_model" and self.reward.model_path is None:
            raise ConfigError("critic.init=reward_model: needs reward.model_path (the checkpoint to start from)")
        if self.critic.warmup_iterations >= self.iterations:
            raise ConfigError(f"critic.warmup_iterations={self.critic.warmup_iterations}: leaves none of the "
                              f"iterations={self.iterations} to the actor")
        if self.actor.lr > self.critic.lr:
            log.warning("actor.lr=%g is above critic.lr=%g: PPO tends to diverge when the policy moves faster "
                        "than its value estimates follow", self.actor.lr, self.critic.lr)

    def _check_reward_and_env(self) -> None:
        """A job needs a reward: a function, a model, or an env's turn rewards. An env's episodes
        are multi-turn, which speculative rollout does not handle yet."""
        reward = self.reward
        if reward.function is None and reward.model_path is None and self.env is None:
            raise ConfigError("reward.function=None, reward.model_path=None: a reward function or a model_path is "
                              "needed (or an env, whose turn rewards are then the reward)")
        if self.env is None:
            return
        if self.rollout.medusa.enabled:
            raise ConfigError(f"rollout.medusa.enabled=true: speculative rollout is single-turn for now, "
                              f"env.factory={self.env.factory!r} runs multi-turn episodes")
        if self.env.tools and self.data.train is None:
            log.warning("env.tools: the synthetic task's prompts are written without a chat template, so they do "
                        "not describe the tools (a dataset's prompts do: data.train)")
        room = self.rollout.vllm.max_model_len if self.rollout.backend == "vllm" else None
        key = "rollout.vllm.max_model_len"
        if room is None and self.model.path is None:
            room, key = self.model.tiny.max_position_embeddings, "model.tiny.max_position_embeddings"
        if room is not None and self.env.max_episode_tokens > room:
            raise ConfigError(f"env.max_episode_tokens={self.env.max_episode_tokens}: more than {key}={room}, "
                              "the positions an episode's prompt, turns and observations must fit in")

    def _check_dynamic_sampling(self, grouped: bool) -> None:
        """Dynamic sampling chooses among groups of group-relative advantages, up to the groups an
        iteration generates."""
        sampling = self.algorithm.dynamic_sampling
        if sampling is None:
            return
        if not grouped:
            raise ConfigError(f"algorithm.dynamic_sampling: leaves out groups whose advantages are all zero, which "
                              f"needs a group-relative advantage (grpo, rloo), not {self.algorithm.advantage}")
        if self.reward.process is not None:
            raise ConfigError("algorithm.dynamic_sampling: with reward.process the samples of a group of equal "
                              "returns still differ in their step rewards, and so in their advantages")
        prompts = self.rollout_batch.prompts_per_minibatch * self.rollout_batch.minibatches
        if sampling.groups is not None and sampling.groups > prompts:
            raise ConfigError(f"algorithm.dynamic_sampling.groups={sampling.groups}: more than the {prompts} groups "
                              "an iteration generates (rollout_batch.prompts_per_minibatch x minibatches)")

    def _check_lora_reference(self) -> None:
        """The actor's base model is the reference only under LoRA, and only the actor gets it."""
        kl = self.algorithm.kl
        if kl.reference != "lora_base":
            return
        key = "algorithm.kl.reference=lora_base"
        if self.actor.lora is None:
            raise ConfigError(f"{key}: the actor's model is the starting checkpoint with its adapters off only "
                              "under actor.lora; set it, or use ref_forward")
        if kl.coef == 0 and kl.target is None:
            raise ConfigError(f"{key}: algorithm.kl.coef=0 and fixed: there is no KL to compute a reference for")
        if self.algorithm.uses_critic:
            raise ConfigError(f"{key}: critic_train also reads the reference log-probs (its returns carry the KL), "
                              f"and only actor_train would have them; with algorithm.advantage="
                              f"{self.algorithm.advantage} use ref_forward")

    def _check_torch_trainer_keys(self) -> None:
        """LoRA and `gradient_checkpointing` are the torch engine's (megatron recomputes with its own
        `megatron.recompute`); the embedded model's layers have the projections only (a `model.path`
        checkpoint's names are checked at preflight, `driver/preflight.py`)."""
        for key, stage in (("actor", "actor_train"), ("critic", "critic_train")):
            trainer = getattr(self, key)
            if self.placement.of(stage).backend == "megatron":
                if trainer.lora is not None:
                    raise ConfigError(f"{key}.lora: built for the torch backend, and "
                                      f"placement.stages.{stage}.backend=megatron")
                if trainer.gradient_checkpointing:
                    raise ConfigError(f"{key}.gradient_checkpointing: the torch backend's switch; "
                                      f"placement.stages.{stage}.backend=megatron recomputes with "
                                      f"placement.stages.{stage}.megatron.recompute: true")
            lora = trainer.lora
            if lora is None:
                continue
            unknown = [name for name in lora.target_modules if name not in ALL_PROJECTIONS]
            if self.model.path is None and unknown:
                raise ConfigError(f"{key}.lora.target_modules: {unknown} name no linear layer of the embedded model's "
                                  f"decoder layers ({', '.join(ALL_PROJECTIONS)})")

    def _check_stage_placements(self) -> None:
        for stage in self.placement.with_rollout:
            if stage not in STAGE_KINDS or STAGE_KINDS[stage].rollout_side:
                movable = (s for s, kind in STAGE_KINDS.items() if not kind.rollout_side)
                raise ConfigError(f"placement.with_rollout: {stage!r} is not a stage that could leave the train side "
                                  f"({', '.join(movable)})")
        samples = self.rollout_batch.samples_per_minibatch * self.rollout_batch.minibatches
        steps = self.algorithm.train_minibatches
        chunk = -(-samples // steps)  # torch.chunk's part size; the last part holds what is left
        smallest_step = samples % chunk or chunk
        for stage, own in self.placement.stages.items():
            key = f"placement.stages.{stage}"
            if stage not in STAGE_KINDS:
                raise ConfigError(f"{key}: {stage!r} is not a stage ({', '.join(STAGE_KINDS)})")
            if own.ranks > 1 and not STAGE_KINDS[stage].groupable:
                hint = " (use rollout.instances)" if stage == "rollout" else ""
                raise ConfigError(f"{key}.ranks={own.ranks}: only {', '.join(stages_where('groupable'))} run as "
                                  f"groups of ranks{hint}")
            if own.backend == "megatron":
                self._check_megatron(stage, own, key)
            if STAGE_KINDS[stage].trains and own.ranks > smallest_step:
                raise ConfigError(f"{key}.ranks={own.ranks}: an optimizer step has as few as {smallest_step} "
                                  f"samples ({samples} per iteration in algorithm.train_minibatches={steps} "
                                  "steps): every rank needs one")

    def _check_device_groups(self) -> None:
        """Offload policies name what the stage holds; device groups host model stages, in one
        process (under Ray one bundle, so its members ask for the same resources; a member this
        config leaves out is dropped when the dataflow compiles)."""
        for stage, own in self.placement.stages.items():
            key = f"placement.stages.{stage}.offload"
            if own.offload is None:
                continue
            if not STAGE_KINDS[stage].groupable:
                raise ConfigError(f"{key}: {stage} holds no model on a device to offload (only "
                                  f"{', '.join(stages_where('groupable'))} do)")
            kept = [w for w in own.offload.what if w in TRAINING_STATE and not STAGE_KINDS[stage].trains]
            if kept:
                raise ConfigError(f"{key}.what={own.offload.what}: {stage} is forward-only, it keeps no "
                                  f"{' or '.join(kept)}")
            if own.offload.when == "switch" and device_group_of(self.placement, stage) is None:
                raise ConfigError(f"{key}.when=switch: {stage} is in no placement.device_groups entry (use step "
                                  "or iteration)")
            if own.offload.prefetch and device_group_of(self.placement, stage) is None:
                raise ConfigError(f"{key}.prefetch=true: {stage} is in no placement.device_groups entry (a "
                                  "prefetch overlaps another member's step)")
            if self._sharded_on_cuda(stage):
                raise ConfigError(f"{key}: {SHARDED_STAYS.format(stage=stage, ranks=own.ranks)}")
        for name, members in self.placement.device_groups.items():
            key = f"placement.device_groups.{name}"
            if name in STAGE_KINDS:
                raise ConfigError(f"{key}: the group's name is a stage's; name it after what it hosts")
            for member in members:
                if member not in STAGE_KINDS or not STAGE_KINDS[member].device_group:
                    raise ConfigError(f"{key}: {member!r} cannot join a device group (only "
                                      f"{', '.join(stages_where('device_group'))} can)")
                if self._sharded_on_cuda(member):
                    ranks = self.placement.stages[member].ranks
                    raise ConfigError(f"{key}: its members take turns on the device by offloading, and "
                                      f"{SHARDED_STAYS.format(stage=member, ranks=ranks)}")
            pins = {m: self.ray.stage_resources.get(m) for m in members}
            if len({repr(sorted((p or {}).items())) for p in pins.values()}) > 1:
                raise ConfigError(f"{key}: its stages share one process, one Ray bundle on one node, so one "
                                  "ray.stage_resources setting: "
                                  + ", ".join(f"ray.stage_resources.{m}={p}" for m, p in pins.items()))

    def _sharded_on_cuda(self, stage: str) -> bool:
        """The stage trains a torch model sharded over its ranks (FSDP2) on CUDA."""
        own = self.placement.stages.get(stage)
        return (own is not None and own.ranks > 1 and own.backend == "torch" and STAGE_KINDS[stage].trains
                and self.placement.resolved_device() == "cuda")

    def _check_megatron(self, stage: str, own: StagePlacement, key: str) -> None:
        """A megatron stage holds a train engine and a language model (a vision-language model's
        decoder) whose heads and layers its sizes split (a `model.path` checkpoint is checked when
        the engine is built)."""
        if not STAGE_KINDS[stage].groupable:
            raise ConfigError(f"{key}.backend=megatron: only {', '.join(stages_where('groupable'))} hold a train "
                              "engine")
        if self.model.path is None:
            tiny = self.model.tiny
            if tiny.architecture == "qwen3" and tiny.vision is not None:
                raise ConfigError(f"{key}.backend=megatron: model.tiny is Qwen3-VL, whose deepstack image features "
                                  "megatron-core's GPTModel takes no input for; use backend torch")
            check_model(own.megatron, tiny.num_attention_heads, tiny.num_key_value_heads, tiny.num_hidden_layers,
                        f"{key}.megatron")

    def _check_keys_the_algorithm_ignores(self) -> None:
        """A key set away from its default that the chosen estimator never reads is an error, not
        silence (the run would not do what the config says)."""
        algo = self.algorithm
        why = f"algorithm.advantage={algo.advantage} ignores it"
        for key in IGNORED_ALGORITHM_KEYS[algo.advantage]:
            if getattr(algo, key) != getattr(AlgorithmConfig(), key):
                raise ConfigError(f"algorithm.{key}={getattr(algo, key)}: {why}")
        if algo.uses_critic:
            return
        why = f"algorithm.advantage={algo.advantage} has no critic"
        for key in (f.name for f in dataclasses.fields(CriticConfig)):
            if getattr(self.critic, key) != getattr(CRITIC_OPTIMIZER, key):
                raise ConfigError(f"critic.{key}={getattr(self.critic, key)}: {why}")
        for stage in stages_where("critic"):
            if stage in self.placement.stages:
                raise ConfigError(f"placement.stages.{stage}: {why}, so no {stage} stage")
            if stage in self.restarts:
                raise ConfigError(f"restarts.{stage}={self.restarts[stage]}: {why}, so no {stage} stage")

    def restarts_of(self, stage: str) -> int:
        """How often the launcher restarts a crashed instance of `stage` (see `restarts`)."""
        if stage in self.restarts:
            return self.restarts[stage]
        rejoins = stage != "rollout" or self.weights.transport != "cuda_ipc"
        return DEFAULT_RESTARTS if STAGE_KINDS[stage].restartable and rejoins else 0

    @property
    def run_dir(self) -> str:
        return os.path.join(self.runs_dir, self.name)
