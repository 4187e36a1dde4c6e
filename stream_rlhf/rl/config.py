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

Every section is a frozen dataclass; unknown keys, wrong types and impossible combinations fail in
`stream_rlhf.config.build` before any process starts, naming the dotted key and value.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Literal

from stream_rlhf.algos.advantages import ADVANTAGE_ESTIMATORS, NEEDS_CRITIC
from stream_rlhf.backends.megatron.config import check_model
from stream_rlhf.backends.optimizer_config import OptimizerConfig
from stream_rlhf.backends.vllm_config import VllmConfig
from stream_rlhf.broker.topology import BrokerConfig
from stream_rlhf.config import ConfigError, import_dotted
from stream_rlhf.launch.placement import PlacementConfig, StagePlacement, device_group_of
from stream_rlhf.launch.ray_config import RayConfig
from stream_rlhf.resume.config import CheckpointConfig
from stream_rlhf.rl.reward_parts_config import CriticConfig, ProcessRewardConfig
from stream_rlhf.telemetry.sample_log import SampleLogConfig
from stream_rlhf.weights.offload_config import TRAINING_STATE

Estimator = Literal["gae", "grpo", "rloo", "reinforce_pp"]
ALL_STAGES = ("prompts", "vision_prefetch", "rollout", "ref_forward", "reward_forward", "actor_forward", "critic_forward",
              "actor_train", "critic_train", "medusa_train")
GROUP_STAGES = ("ref_forward", "actor_forward", "critic_forward", "actor_train", "critic_train")
"""Stages whose instances can be groups of several ranks (`placement.stages.<stage>.ranks`)."""
DEVICE_GROUP_STAGES = (*GROUP_STAGES, "reward_forward")
"""Stages that can share a process and device with others (`placement.device_groups`)."""
RESTARTABLE = ("vision_prefetch", "rollout", "ref_forward", "reward_forward", "actor_forward", "critic_forward")
DEFAULT_RESTARTS = 2
CRITIC_STAGES = ("critic_forward", "critic_train")
CRITIC_OPTIMIZER = CriticConfig()
"""The critic's settings when `critic` is left out."""
log = logging.getLogger("stream_rlhf")
IGNORED_ALGORITHM_KEYS = {
    "gae": (),
    "grpo": ("gamma", "lam", "value_clip"),
    "rloo": ("gamma", "lam", "value_clip"),
    "reinforce_pp": ("lam", "value_clip"),
}
"""The `algorithm` keys each advantage estimator never reads (`algos/advantages.py`); those without a
critic ignore `critic.*` and the critic stages' placement too. Setting one is a config error."""


@dataclass(frozen=True)
class TinyVisionConfig:
    """The vision tower of a tiny Qwen2-VL-architecture model (a ViT over patch_size pixel patches;
    every spatial_merge_size x spatial_merge_size patches become one image token of the LM)."""

    depth: int = 2
    embed_dim: int = 64
    num_heads: int = 2
    mlp_ratio: int = 2
    patch_size: int = 8
    temporal_patch_size: int = 2
    """Qwen2-VL encodes an image as two identical frames (a video of length temporal_patch_size)."""
    spatial_merge_size: int = 2

    def __post_init__(self) -> None:
        for name in ("depth", "embed_dim", "num_heads", "mlp_ratio", "patch_size", "temporal_patch_size",
                     "spatial_merge_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.embed_dim % self.num_heads:
            raise ConfigError(f"num_heads={self.num_heads}: must divide embed_dim={self.embed_dim}")


@dataclass(frozen=True)
class TinyModelConfig:
    """A random-initialised Qwen2-architecture model (vocabulary from the project's tokenizer); with
    `vision` set, a Qwen2-VL-architecture vision-language model."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    """vLLM serves only head_dim >= 32."""
    max_position_embeddings: int = 64
    vision: TinyVisionConfig | None = None
    """The vision tower; None: a text-only model."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.head_dim < 32:
            raise ConfigError(f"head_dim={self.head_dim}: must be >= 32 (vLLM cannot serve less)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_key_value_heads={self.num_key_value_heads}: must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )


@dataclass(frozen=True)
class WarmStartConfig:
    """Short SFT on the task's train split so RL starts from a policy that sometimes succeeds."""

    steps: int = 400
    batch_size: int = 64
    lr: float = 1e-3
    cache_dir: str = "runs/.cache"
    """Finished warm starts are kept here, keyed by a hash of model, task and these settings."""

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ConfigError(f"steps={self.steps}: must be >= 0")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size={self.batch_size}: must be >= 1")
        if not self.lr > 0:
            raise ConfigError(f"lr={self.lr}: must be > 0")


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = None
    """A Hugging Face checkpoint folder (config, weights, tokenizer). None: the embedded tiny model."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.path is not None and not os.path.isfile(os.path.join(self.path, "config.json")):
            raise ConfigError(f"path={self.path!r}: no config.json there (expected a Hugging Face checkpoint folder)")


@dataclass(frozen=True)
class TaskConfig:
    """The synthetic task: prompts, references and the split evaluation uses.

    arithmetic  "a+b=" prompts made in memory (text models); with `terms` > 2 the multi-step
                form "12+7+30=" answered with its partial sums "19,49", each a checkable step.
    shapes      coloured squares in 32x32 images with questions about them (vision-language
                models); written once as JSONL + PNG files under `data_dir` and read like `data`.
    """

    name: Literal["arithmetic", "shapes"] = "arithmetic"
    max_operand: int = 99
    """arithmetic: the largest operand."""
    terms: int = 2
    """arithmetic: operands per prompt; > 2 asks for every partial sum (the multi-step task)."""
    train_prompts: int = 4096
    """shapes: prompts written for the train split (RL and the warm start cycle over them)."""
    eval_prompts: int = 256
    seed: int = 0
    data_dir: str = "runs/.cache"
    """shapes: where the generated dataset is kept (a folder per task setting, reused by later runs)."""

    def __post_init__(self) -> None:
        if self.max_operand < 1:
            raise ConfigError(f"max_operand={self.max_operand}: must be >= 1")
        if self.terms < 2:
            raise ConfigError(f"terms={self.terms}: must be >= 2")
        if self.terms != 2 and self.name != "arithmetic":
            raise ConfigError(f"terms={self.terms}: only the arithmetic task has terms")
        if self.eval_prompts < 1 or self.train_prompts < 1:
            raise ConfigError(f"train_prompts={self.train_prompts}, eval_prompts={self.eval_prompts}: must be >= 1")


@dataclass(frozen=True)
class DataConfig:
    """A JSONL prompt dataset in place of the synthetic task's prompts, one object per line:

        {"prompt": "<image>how many red?", "images": ["images/1.png"], "answer": "2"}

    Relative image paths are relative to the JSONL file; each `<image>` marker in the prompt takes
    the next image (`images` may be absent for text-only lines). `answer` is the reference the
    reward function receives.
    """

    train: str | None = None
    """The RL (and warm-start) prompts; None: the synthetic task's."""
    eval: str | None = None
    """The held-out prompts of the before/after evaluation; required with `train`."""
    on_bad_sample: Literal["error", "skip"] = "error"
    """error: a bad line (unreadable JSON, missing or corrupt image, unsupported image size, image
    markers that do not match the images) stops the run naming file and line. skip: it is left
    out, counted by reason and reported in the summary."""
    min_pixels: int = 16 * 16
    """Images are resized (keeping their aspect ratio) to at least this many pixels..."""
    max_pixels: int = 448 * 448
    """...and at most this many, with sides rounded to the vision tower's patch grid."""
    max_images_per_prompt: int = 4

    def __post_init__(self) -> None:
        if (self.train is None) != (self.eval is None):
            raise ConfigError(f"train={self.train!r}, eval={self.eval!r}: give both or neither")
        for name in ("train", "eval"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"{name}={path!r}: no such file")
        if not 1 <= self.min_pixels <= self.max_pixels:
            raise ConfigError(f"min_pixels={self.min_pixels}, max_pixels={self.max_pixels}: need 1 <= min <= max")
        if self.max_images_per_prompt < 1:
            raise ConfigError(f"max_images_per_prompt={self.max_images_per_prompt}: must be >= 1")


@dataclass(frozen=True)
class VisionConfig:
    """The vision_prefetch stage of a vision-language model (ignored for text models)."""

    prefetch: bool = True
    """true: the vision_prefetch stage runs the frozen vision tower once per image, ahead of
    rollout, and every other stage reads its features. false: every stage that needs the
    features (rollout, forwards, trainers) runs the vision tower itself (the baseline that
    bench/vision.py compares against)."""
    prefetch_depth: int = 2
    """Mini-batches of features the vision stage may hold ready at the broker beyond what rollout
    has taken (rollout's runner itself takes up to 2 into its input queue)."""
    instances: int = 1
    """Data-parallel instances of the vision stage (independent of the language model's)."""

    def __post_init__(self) -> None:
        if self.prefetch_depth < 1 or self.instances < 1:
            raise ConfigError(f"prefetch_depth={self.prefetch_depth}, instances={self.instances}: must be >= 1")


@dataclass(frozen=True)
class RolloutBatchConfig:
    prompts_per_minibatch: int = 32
    minibatches: int = 2
    """Mini-batches per iteration (per rollout batch)."""
    samples_per_prompt: int = 1
    """Responses per prompt; GRPO and RLOO need >= 2 (they normalise within a prompt's group)."""

    def __post_init__(self) -> None:
        for name in ("prompts_per_minibatch", "minibatches", "samples_per_prompt"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 1")

    @property
    def samples_per_minibatch(self) -> int:
        return self.prompts_per_minibatch * self.samples_per_prompt


@dataclass(frozen=True)
class MedusaConfig:
    """Medusa heads for lossless speculative rollout, trained beside the actor (companion training).

    Rollout proposes `heads` tokens from the heads and verifies them with one backbone forward;
    the sampled distribution stays exactly the backbone's. The `medusa_train` stage fine-tunes
    the heads on each iteration's experiences with the backbone frozen and publishes them; rollout
    uses heads trained against a backbone at most `max_lag` versions older than its own, and
    decodes plainly otherwise (counted).
    """

    enabled: bool = False
    heads: int = 3
    lr: float = 1e-3
    max_lag: int = 2
    """Policy versions the heads' backbone may trail rollout's before rollout stops using them."""
    companion: bool = True
    """false: the heads stay as the warm start left them (stale heads, for comparison)."""
    epochs: int = 1
    """Passes of the heads' training over each iteration's experiences."""
    warm_start_steps: int = 200
    """Steps training the heads on the warm-started policy's hidden states (embedded tiny model)."""
    probe_every: int = 8
    """Every this many mini-batches rollout decodes one plainly, to compare speeds: speculation
    turns itself off while it is slower than plain decoding, and says so."""

    def __post_init__(self) -> None:
        for name in ("heads", "epochs", "probe_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.max_lag < 0 or self.warm_start_steps < 0:
            raise ConfigError(f"max_lag={self.max_lag}, warm_start_steps={self.warm_start_steps}: must be >= 0")
        if self.lr <= 0:
            raise ConfigError(f"lr={self.lr}: must be > 0")


@dataclass(frozen=True)
class WeightSyncConfig:
    """How rollout gets each new policy version from actor_train (`stream_rlhf/weights/`)."""

    transport: Literal["shm", "broadcast", "cuda_ipc"] = "shm"
    """`shm`: the version's safetensors file in /dev/shm (one host); `broadcast`: a
    torch.distributed group per rollout instance (gloo on CPU, NCCL on GPUs) sending the weights in
    buckets; `cuda_ipc`: CUDA IPC handles (trainer and rollout on one GPU)."""
    update: Literal["drain", "in_flight"] = "drain"
    """`drain`: between mini-batches; `in_flight` (vLLM): between engine steps, requests keep their
    KV cache and each token records the version that sampled it."""
    bucket_mb: int = 64
    """`broadcast` / `cuda_ipc`: parameters travel in flat buckets of at most this many MiB."""
    timeout_s: float = 180.0
    """How long a weight-sync group waits for its ranks to join."""

    def __post_init__(self) -> None:
        if self.bucket_mb < 1:
            raise ConfigError(f"bucket_mb={self.bucket_mb}: must be >= 1")
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout_s={self.timeout_s}: must be > 0")


@dataclass(frozen=True)
class RolloutConfig:
    backend: Literal["torch", "vllm"] = "torch"
    """`torch`: our KV-cache sampler; `vllm`: a vLLM engine per instance (the `vllm` extra)."""
    instances: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 6
    stop: list[str] | None = None
    """Tokens that end a response (kept in it); None: the tokenizer's end-of-sequence token."""
    medusa: MedusaConfig = field(default_factory=MedusaConfig)
    vllm: VllmConfig = field(default_factory=VllmConfig)

    def __post_init__(self) -> None:
        if self.instances < 1:
            raise ConfigError(f"instances={self.instances}: must be >= 1")
        if self.temperature < 0:
            raise ConfigError(f"temperature={self.temperature}: must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens}: must be >= 1")
        if self.backend == "vllm" and self.top_p < 1:
            # vLLM reports log-probs of the top-p-truncated distribution; the pipeline's behaviour
            # log-probs are under the full tempered one (what the forwards recompute)
            raise ConfigError(f"top_p={self.top_p}: backend=vllm needs top_p 1 (its log-probs would be "
                              "of the truncated distribution)")
        if self.backend == "vllm" and self.medusa.enabled:
            raise ConfigError("medusa.enabled=true: Medusa speculative rollout is built on backend=torch")


@dataclass(frozen=True)
class RewardConfig:
    """Score = function_weight * function(prompt, response, reference) + model_weight * reward model,
    on each response's last token; `process` adds step rewards (`reward_parts_config.py`)."""

    function: str | None = "stream_rlhf.data.arithmetic:reward"
    """Dotted path "package.module:name" of a rule-based reward; None for none."""
    function_weight: float = 1.0
    model_path: str | None = None
    """A Hugging Face sequence-classification checkpoint with one label (the scalar head)."""
    model_weight: float = 1.0
    process: ProcessRewardConfig | None = None
    """Process rewards at the steps of a response (a rule function or a PRM); None: outcome only."""

    def __post_init__(self) -> None:
        if self.function is None and self.model_path is None:
            raise ConfigError("function=None: a reward function or a model_path is needed")
        if self.function is not None and not callable(import_dotted(self.function, "function")):
            raise ConfigError(f"function={self.function!r}: not callable (expected fn(prompt, response, reference))")
        if self.model_path is not None and not os.path.isfile(os.path.join(self.model_path, "config.json")):
            raise ConfigError(f"model_path={self.model_path!r}: no config.json there")


@dataclass(frozen=True)
class KLConfig:
    kind: Literal["k1", "k2", "k3"] = "k1"
    placement: Literal["reward", "loss"] = "reward"
    """`reward`: -coef * KL per token is added to the reward; `loss`: coef * KL is added to the loss."""
    coef: float = 0.01
    target: float | None = None
    """Set to make the coefficient adaptive (Ziegler et al.): it moves to keep KL near target."""
    horizon: int = 10_000

    def __post_init__(self) -> None:
        if self.coef < 0:
            raise ConfigError(f"coef={self.coef}: must be >= 0")
        if self.target is not None and self.target <= 0:
            raise ConfigError(f"target={self.target}: must be > 0")
        if self.horizon < 1:
            raise ConfigError(f"horizon={self.horizon}: must be >= 1")


@dataclass(frozen=True)
class AlgorithmConfig:
    advantage: Estimator = "gae"
    gamma: float = 1.0
    lam: float = 0.95
    clip_low: float = 0.2
    clip_high: float = 0.2
    value_clip: float = 0.2
    is_cap: float = 2.0
    """Truncation of the behaviour importance weight (decoupled PPO, overlap_depth >= 1)."""
    entropy_coef: float = 0.0
    whiten_advantages: bool = True
    """Whiten over the whole rollout batch (every mini-batch of the iteration)."""
    ppo_epochs: int = 2
    train_minibatches: int = 2
    """Optimizer steps per epoch: the iteration's samples are split into this many."""
    kl: KLConfig = field(default_factory=KLConfig)

    def __post_init__(self) -> None:
        if self.advantage not in ADVANTAGE_ESTIMATORS:
            raise ConfigError(f"advantage={self.advantage!r}: unknown")
        if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
            raise ConfigError(f"gamma={self.gamma}, lam={self.lam}: must be in [0, 1]")
        if self.ppo_epochs < 1 or self.train_minibatches < 1:
            raise ConfigError(f"ppo_epochs={self.ppo_epochs}, train_minibatches={self.train_minibatches}: must be >= 1")
        if self.is_cap < 1:
            raise ConfigError(f"is_cap={self.is_cap}: must be >= 1")
        for name in ("clip_low", "clip_high", "value_clip", "entropy_coef"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 0")
        if self.clip_low >= 1:
            raise ConfigError(f"clip_low={self.clip_low}: must be < 1 (the ratio's lower bound is 1 - clip_low)")

    @property
    def uses_critic(self) -> bool:
        return self.advantage in NEEDS_CRITIC


@dataclass(frozen=True)
class RLJobConfig:
    name: str
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    schedule: Literal["stream", "sync"] = "stream"
    overlap_depth: int = 1
    """How many policy versions rollout may run ahead of training (0: on-policy)."""
    iterations: int = 20
    rollout_batch: RolloutBatchConfig = field(default_factory=RolloutBatchConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    actor: OptimizerConfig = field(default_factory=OptimizerConfig)
    critic: CriticConfig = field(default_factory=lambda: CRITIC_OPTIMIZER)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    weights: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    runs_dir: str = "runs"
    seed: int = 0
    timeout_s: float = 900.0
    restarts: dict[str, int] = field(default_factory=dict)
    """Stage -> how often the launcher restarts a crashed instance (stateless stages only: rollout
    and the forwards; redelivery gives the new instance the unfinished mini-batches). A stateless
    stage left out restarts up to DEFAULT_RESTARTS times (rollout only with weights.transport shm);
    0 turns it off. A crash no restart covers resumes the run (`checkpoint.recoveries`)."""
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
        if not self.name or "/" in self.name:
            raise ConfigError(f"name={self.name!r}: a non-empty folder name")
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout_s={self.timeout_s}: must be > 0")
        if self.iterations < 1:
            raise ConfigError(f"iterations={self.iterations}: must be >= 1")
        if self.overlap_depth < 0:
            raise ConfigError(f"overlap_depth={self.overlap_depth}: must be >= 0")
        if self.schedule == "sync" and self.overlap_depth != 0:
            raise ConfigError(f"overlap_depth={self.overlap_depth}: schedule=sync is on-policy, needs 0")
        grouped = self.algorithm.advantage in ("grpo", "rloo")
        if grouped and self.rollout_batch.samples_per_prompt < 2:
            raise ConfigError(
                f"rollout_batch.samples_per_prompt={self.rollout_batch.samples_per_prompt}: "
                f"algorithm.advantage={self.algorithm.advantage} needs >= 2 samples per prompt"
            )
        samples = self.rollout_batch.samples_per_minibatch * self.rollout_batch.minibatches
        if self.algorithm.train_minibatches > samples:
            raise ConfigError(
                f"algorithm.train_minibatches={self.algorithm.train_minibatches}: more than the {samples} "
                "samples of an iteration"
            )

        if self.rollout.medusa.enabled and (self.model.tiny.vision is not None or self.task.name == "shapes"):
            raise ConfigError("rollout.medusa.enabled=true: speculative rollout is text-only for now")
        if self.task.name == "shapes" and self.model.path is None and self.model.tiny.vision is None:
            raise ConfigError("task.name=shapes: asks about images, needs a vision-language model "
                              "(model.tiny.vision, or a Qwen2-VL model.path)")
        if self.weights.update == "in_flight" and self.rollout.backend != "vllm":
            raise ConfigError("weights.update=in_flight: needs rollout.backend=vllm (the torch backend updates "
                              "between mini-batches)")
        if self.weights.transport != "shm" and self.restarts.get("rollout", 0):
            raise ConfigError(f"restarts.rollout={self.restarts['rollout']}: a restarted instance cannot rejoin "
                              f"its weights.transport={self.weights.transport} group; use transport shm")
        for stage, count in self.restarts.items():
            if stage not in RESTARTABLE:
                raise ConfigError(f"restarts.{stage}={count}: only {', '.join(RESTARTABLE)} can restart "
                                  "(the others hold state a restart would lose)")
            if count < 0:
                raise ConfigError(f"restarts.{stage}={count}: must be >= 0")
        self._check_stage_placements()
        self._check_device_groups()
        self._check_keys_the_algorithm_ignores()
        self._check_launcher()
        self._check_critic()

    def _check_launcher(self) -> None:
        if self.launcher != "ray" and self.ray != RayConfig():
            raise ConfigError(f"ray: set, but launcher={self.launcher} never reads it (launcher: ray)")
        for stage in self.ray.stage_resources:
            if stage not in ALL_STAGES and stage != "broker":
                raise ConfigError(f"ray.stage_resources.{stage}: not a stage ({', '.join(ALL_STAGES)}) or broker")

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

    def _check_stage_placements(self) -> None:
        samples = self.rollout_batch.samples_per_minibatch * self.rollout_batch.minibatches
        steps = self.algorithm.train_minibatches
        chunk = -(-samples // steps)  # torch.chunk's part size; the last part holds what is left
        smallest_step = samples % chunk or chunk
        for stage, own in self.placement.stages.items():
            key = f"placement.stages.{stage}"
            if stage not in ALL_STAGES:
                raise ConfigError(f"{key}: {stage!r} is not a stage ({', '.join(ALL_STAGES)})")
            if own.ranks > 1 and stage not in GROUP_STAGES:
                hint = " (use rollout.instances)" if stage == "rollout" else ""
                raise ConfigError(f"{key}.ranks={own.ranks}: only {', '.join(GROUP_STAGES)} run as groups of "
                                  f"ranks{hint}")
            if own.backend == "megatron":
                self._check_megatron(stage, own, key)
            if stage.endswith("_train") and own.ranks > smallest_step:
                raise ConfigError(f"{key}.ranks={own.ranks}: an optimizer step has as few as {smallest_step} "
                                  f"samples ({samples} per iteration in algorithm.train_minibatches={steps} "
                                  "steps): every rank needs one")

    def _check_device_groups(self) -> None:
        """Offload policies name what the stage holds; device groups host model stages the local
        launcher starts (a member this config leaves out is dropped when the dataflow compiles)."""
        for stage, own in self.placement.stages.items():
            key = f"placement.stages.{stage}.offload"
            if own.offload is None:
                continue
            if stage not in GROUP_STAGES:
                raise ConfigError(f"{key}: {stage} holds no model on a device to offload (only "
                                  f"{', '.join(GROUP_STAGES)} do)")
            kept = [w for w in own.offload.what if w in TRAINING_STATE and not stage.endswith("_train")]
            if kept:
                raise ConfigError(f"{key}.what={own.offload.what}: {stage} is forward-only, it keeps no "
                                  f"{' or '.join(kept)}")
            if own.offload.when == "switch" and device_group_of(self.placement, stage) is None:
                raise ConfigError(f"{key}.when=switch: {stage} is in no placement.device_groups entry (use step "
                                  "or iteration)")
        for name, members in self.placement.device_groups.items():
            key = f"placement.device_groups.{name}"
            if name in ALL_STAGES:
                raise ConfigError(f"{key}: the group's name is a stage's; name it after what it hosts")
            for member in members:
                if member not in DEVICE_GROUP_STAGES:
                    raise ConfigError(f"{key}: {member!r} cannot join a device group (only "
                                      f"{', '.join(DEVICE_GROUP_STAGES)} can)")
            if self.launcher != "local":
                raise ConfigError(f"{key}: launcher={self.launcher} does not host device groups yet (launcher: local)")

    def _check_megatron(self, stage: str, own: StagePlacement, key: str) -> None:
        """A megatron stage holds a train engine and a text model whose heads and layers its sizes
        split (a `model.path` checkpoint is checked when the engine is built)."""
        if stage not in GROUP_STAGES:
            raise ConfigError(f"{key}.backend=megatron: only {', '.join(GROUP_STAGES)} hold a train engine")
        if stage.startswith("critic") and (self.model.tiny.vision is not None or self.task.name == "shapes"):
            raise ConfigError(f"{key}.backend=megatron: vision-language critics are not mapped to megatron yet")
        if self.model.path is None:
            tiny = self.model.tiny
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
        for stage in CRITIC_STAGES:
            if stage in self.placement.stages:
                raise ConfigError(f"placement.stages.{stage}: {why}, so no {stage} stage")
            if stage in self.restarts:
                raise ConfigError(f"restarts.{stage}={self.restarts[stage]}: {why}, so no {stage} stage")

    def restarts_of(self, stage: str) -> int:
        """How often the launcher restarts a crashed instance of `stage` (see `restarts`)."""
        if stage in self.restarts:
            return self.restarts[stage]
        rejoins = stage != "rollout" or self.weights.transport == "shm"
        return DEFAULT_RESTARTS if stage in RESTARTABLE and rejoins else 0

    @property
    def run_dir(self) -> str:
        return os.path.join(self.runs_dir, self.name)
