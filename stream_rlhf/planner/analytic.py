"""Stage costs from the model's size and the tokens of a mini-batch, without a calibration run.

    shape = ModelShape(hidden=128, intermediate=384, layers=2, heads=4, kv_heads=2, head_dim=32, vocab=49)
    work = Workload(rows=64, prompt_tokens=7, response_tokens=5, minibatches=4, ppo_epochs=2, train_minibatches=2)
    profile = analytic_profile(stages, shape, work, device)     # a calibrate.Profile
    simulate(profile.graph(...))                                # as a calibrated one

A pass over T tokens of a model of P parameters and L layers on a device of rate F (FLOP/s),
memory bandwidth B, b bytes per weight and overheads o (per layer of a forward) and o_d (per
layer of a decode step), split over n ranks (data parallel, efficiency e when n > 1):

    forward      2 P T / (n e F)  + (L + 1) o
    train        ppo_epochs x (6 P T / (n e F) + 3 (L + 1) o)  + steps x (P x 28 / B + all-reduce)
                 steps = ppo_epochs x train_minibatches optimizer steps, each reading and writing
                 weights, gradients and Adam's two moments in fp32 (28 bytes a weight); all-reduce
                 2 (n - 1) / n x P b / link bandwidth. With LoRA adapters of P_a parameters (the
                 trainer's `lora_rank`): 4 P T + 6 P_a T FLOPs a pass (no gradient of a frozen
                 weight), and the step and the all-reduce over P_a
    rollout      prefill: a forward over rows x prompt tokens; then per response token one decode
                 step  max(2 P rows / F, P b / B) + (L + 1) o_d; n instances take mini-batches in
                 turn: / n
    publish      P b / link bandwidth          load   P b / B

A trainer trains on an iteration's last mini-batch (its cost is all at that position, as a
calibrated profile's); actor_train also runs the forward of the proximal log-probs when the
job has no actor_forward stage (overlap_depth >= 1), and the reference's with
`algorithm.kl.reference: lora_base` (`Workload.reference_in_trainer`). Not modelled: attention's FLOPs (they grow
with the sequence: short sequences here), the vision tower (vision_prefetch costs 0), Medusa
heads (medusa_train costs 0), reward functions (0; a reward model: a forward) and the broker's
transfers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from stream_rlhf.driver.dataflow import ROLLOUT_SIDE
from stream_rlhf.planner.calibrate import Profile
from stream_rlhf.planner.devices import DeviceFigures
from stream_rlhf.rl.stage_kinds import STAGE_KINDS

ADAM_BYTES = 28
"""Bytes an Adam step moves per weight: reads weight, gradient, two moments; writes three (fp32)."""


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's sizes (Hugging Face config keys)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = True
    """The output head shares the embedding's weights."""
    lora_rank: int = 0
    """A trainer's LoRA adapters (`actor.lora`, `critic.lora`): their rank; 0: the whole model trains."""
    lora_targets: tuple[str, ...] = ()
    """The projections the adapters are on (`lora.target_modules`)."""

    @property
    def trained(self) -> int:
        """Parameters an optimizer step updates: all of them, or the adapters (rank x (in + out) per
        targeted projection and layer; a projection not of this table counted hidden x hidden)."""
        if not self.lora_rank:
            return self.params
        h, i, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        sides = {"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h, "gate_proj": h + i,
                 "up_proj": h + i, "down_proj": i + h}
        return self.layers * self.lora_rank * sum(sides.get(name, 2 * h) for name in self.lora_targets)

    @property
    def params(self) -> int:
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads) \
            + self.head_dim * (self.heads + 2 * self.kv_heads)  # q, k, v biases (Qwen2)
        layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.layers * layer + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden


@dataclass(frozen=True)
class Workload:
    """The tokens of one job's mini-batch and how often the trainers pass over them."""

    rows: int
    """Sequences of a mini-batch (prompts x samples per prompt)."""
    prompt_tokens: float
    response_tokens: float
    """Decode steps of rollout per mini-batch (the longest response: rows decode together)."""
    minibatches: int
    """Mini-batches per iteration."""
    ppo_epochs: int = 1
    train_minibatches: int = 1
    """Optimizer steps per epoch."""
    reference_in_trainer: bool = False
    """actor_train computes the reference log-probs too (`algorithm.kl.reference: lora_base`)."""

    @property
    def tokens(self) -> float:
        """Tokens of a mini-batch: rows x (prompt + response)."""
        return self.rows * (self.prompt_tokens + self.response_tokens)


def forward_s(shape: ModelShape, tokens: float, device: DeviceFigures, ranks: int = 1) -> float:
    return 2 * shape.params * tokens / _rate(device, ranks) + (shape.layers + 1) * device.layer_overhead_s


def train_s(shape: ModelShape, work: Workload, device: DeviceFigures, ranks: int = 1) -> float:
    """One iteration's training: every mini-batch's tokens, ppo_epochs times."""
    tokens = work.tokens * work.minibatches
    flops = 6 * shape.params if not shape.lora_rank else 4 * shape.params + 6 * shape.trained  # per token
    passes = work.ppo_epochs * (flops * tokens / _rate(device, ranks)
                                + 3 * (shape.layers + 1) * device.layer_overhead_s * work.train_minibatches)
    steps = work.ppo_epochs * work.train_minibatches
    return passes + steps * (shape.trained * ADAM_BYTES / ranks / device.bandwidth + allreduce_s(shape, device, ranks))


def allreduce_s(shape: ModelShape, device: DeviceFigures, ranks: int) -> float:
    """A ring all-reduce of the gradients over `ranks` devices."""
    return 2 * (ranks - 1) / ranks * shape.trained * device.bytes_per_param / device.link_bandwidth


def rollout_s(shape: ModelShape, work: Workload, device: DeviceFigures, instances: int = 1) -> float:
    """One mini-batch's generation (prefill and decode), per instance's share when there are several."""
    step = max(2 * shape.params * work.rows / device.rate, weight_bytes(shape, device) / device.bandwidth)
    decode = work.response_tokens * (step + (shape.layers + 1) * device.decode_overhead_s)
    return (forward_s(shape, work.rows * work.prompt_tokens, device) + decode) / instances


def weight_bytes(shape: ModelShape, device: DeviceFigures) -> float:
    return shape.params * device.bytes_per_param


def stage_step_s(stage: str, stages: set[str], shape: ModelShape, work: Workload, device: DeviceFigures,
                 ranks: int = 1) -> tuple[float, ...]:
    """A stage's cost per mini-batch position of an iteration (module docstring), on `ranks` devices."""
    flat = (0.0,) * work.minibatches
    if stage == "rollout":
        return (rollout_s(shape, work, device, ranks),) * work.minibatches
    kind = STAGE_KINDS.get(stage)
    policy_sized = kind is not None and kind.groupable  # a copy of the policy's architecture
    if policy_sized and kind.work == "forward":
        return (forward_s(shape, work.tokens, device, ranks),) * work.minibatches
    if policy_sized and kind.trains:
        cost = train_s(shape, work, device, ranks)
        if stage == "actor_train":  # the proximal forward without an actor_forward; the reference's with lora_base
            forwards = ("actor_forward" not in stages) + work.reference_in_trainer
            cost += forwards * forward_s(shape, work.tokens * work.minibatches, device, ranks)
        return (*flat[:-1], cost)
    return flat  # prompts, reward functions, vision_prefetch, medusa_train: not modelled


def analytic_profile(stages: Mapping[str, tuple[str, ...]], shape: ModelShape, work: Workload,
                     device: DeviceFigures, ranks: Mapping[str, int] | None = None,
                     shapes: Mapping[str, ModelShape] | None = None) -> Profile:
    """The costs of `stages` (stage -> the stages it consumes) on `device`, each on its `ranks`
    devices (absent: 1); `shapes`: per stage, a model other than the policy `shape` (a reward
    model makes reward_forward a forward of it)."""
    ranks, shapes = ranks or {}, shapes or {}
    names = set(stages)
    step_s = {}
    for stage in stages:
        if stage == "reward_forward" and stage in shapes:
            step_s[stage] = (forward_s(shapes[stage], work.tokens, device, ranks.get(stage, 1)),) * work.minibatches
        else:
            step_s[stage] = stage_step_s(stage, names, shapes.get(stage, shape), work, device, ranks.get(stage, 1))
    return Profile(step_s=step_s, minibatches=work.minibatches, inputs=dict(stages),
                   rollout_side=frozenset(ROLLOUT_SIDE & names),
                   publish_s=weight_bytes(shape, device) / device.link_bandwidth,
                   weights_load_s=weight_bytes(shape, device) / device.bandwidth)


def _rate(device: DeviceFigures, ranks: int) -> float:
    """FLOP/s of `ranks` devices together."""
    return device.rate * ranks * (device.dp_efficiency if ranks > 1 else 1.0)
