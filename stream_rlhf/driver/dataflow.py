"""Compiles an RL job config into the broker's dataflow and the stage processes of the launcher.

    prompts ─► rollout ─┬─► ref_forward ────┐
                        ├─► reward_forward ─┤  join by (iteration, mini-batch)
                        ├─► actor_forward ──┤──────────► experience ─┬─► actor_train ─► weights v+1
                        └─► critic_forward ─┘  (PPO)                 └─► critic_train (PPO)

The forwards a config never needs are left out (`left_out_stages`): the reference without a KL
or when actor_train computes it (`algorithm.kl.reference: lora_base`),
the actor forward whenever rollout may run ahead (overlap_depth >= 1: actor_train computes the
proximal log-probs itself) or one optimizer step gives them, the critic's without a critic.
Without an actor forward the KL is the sampling policy's (its behaviour log-probs) against the
reference.

A vision-language model adds the vision stage and lets every later stage read its features:

    prompts ─► vision_prefetch ─► vision ─► rollout ─► rollout
                                  generated = join(rollout, vision)        ─► the forwards
                                  experience = join(rollout, vision, parts) ─► the trainers

With `vision.prefetch: false` there is no vision stage and `prompts` (pixel patches) takes the
place of `vision`: each stage then runs the vision tower itself.

With `rollout.medusa` enabled (and companion training on), `medusa_train` is a third consumer
of the experiences, beside the actor and critic trainers. GRPO, RLOO and REINFORCE++ have no
critic stages. At a stop the broker lets the checkpointed trainers (actor, critic) catch up with
each other's experience mini-batches first, so the checkpoint a drain leaves is complete.
Admission holds the prompts of iteration i
until training has published version i - overlap_depth. The `sync` schedule adds barriers: a
mini-batch of rollout (or experience) is delivered only when every mini-batch of its iteration
has been published there, so generation, forwards and training run phase by phase.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from stream_rlhf.backends.core_board import CoreLending
from stream_rlhf.broker.control.admission import OverlapAdmission, PhaseAdmission
from stream_rlhf.broker.control.topology import TopicConfig, Topology
from stream_rlhf.config import ConfigError
from stream_rlhf.launch.placement import RankPlacement, preflight, stage_ranks
from stream_rlhf.launch.plan import Dataflow
from stream_rlhf.launch.spec import StageSpec
from stream_rlhf.resume.store import ResumePoint
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.rl.stage_kinds import STAGE_KINDS, stages_where
from stream_rlhf.stages.job_context import JobContext
from stream_rlhf.telemetry.trace import FOLDER as TRACE_FOLDER
from stream_rlhf.weights.offload_config import OffloadPolicy, default_group_policy
from stream_rlhf.weights.transport import TRANSPORTS

log = logging.getLogger(__name__)
ROLLOUT_SIDE = frozenset(stages_where("rollout_side"))
"""Stages placed on `placement.rollout_cores` when separated (with `placement.with_rollout`); the
rest go on `train_cores`."""
NO_MODEL = {"prompts", "reward_forward"}
"""Stages whose work stays on the CPU whatever `placement.device` says (the reward is a rule, or a
reward model scored on the CPU)."""


def left_out_stages(cfg: RLJobConfig) -> dict[str, str]:
    """The forward stages whose output this config would never use, and why."""
    algo = cfg.algorithm
    out = {}
    if not algo.uses_critic:
        out["critic_forward"] = f"algorithm.advantage={algo.advantage} has no critic"
    if algo.kl.coef == 0 and algo.kl.target is None:
        out["ref_forward"] = "algorithm.kl.coef=0 and fixed (no kl.target): no KL to compute"
    elif algo.kl.reference == "lora_base":
        out["ref_forward"] = ("algorithm.kl.reference=lora_base: actor_train computes the reference log-probs with "
                              "its LoRA adapters off")
    if cfg.overlap_depth >= 1:
        out["actor_forward"] = (f"overlap_depth={cfg.overlap_depth}: rollout runs ahead of training, so a forward "
                                "before training would have older weights than the proximal policy; actor_train "
                                "computes the proximal log-probs itself, once, from the weights it starts from")
    elif algo.ppo_epochs == 1 and algo.train_minibatches == 1:
        out["actor_forward"] = ("one optimizer step per iteration (ppo_epochs=1, train_minibatches=1): "
                                "the proximal log-probs are the training forward's own, detached")
    return out


def compile_job(cfg: RLJobConfig, checkpoint: str, weights_root: str, vision_language: bool = False,
                resume: ResumePoint | None = None) -> Dataflow:
    """The dataflow of `cfg` starting from `checkpoint` (`vision_language`: it has a vision tower),
    or continuing from the run checkpoint `resume`."""
    if TRANSPORTS[cfg.weights.transport].needs_cuda and not torch.cuda.is_available():
        raise ConfigError(f"weights.transport={cfg.weights.transport}: needs a CUDA device shared by the trainer and "
                          "rollout; this machine has none (use shm or broadcast)")
    critic = cfg.algorithm.uses_critic
    left_out = left_out_stages(cfg)
    for stage in left_out:  # why each is left out: the job plan's "left out" lines
        if stage in cfg.placement.stages:
            log.warning("placement.stages.%s: not used, this config has no %s stage", stage, stage)
    if cfg.placement.with_rollout and cfg.placement.mode != "separated":
        log.info("placement.with_rollout: not used with placement.mode=%s (every stage on every core)",
                 cfg.placement.mode)
    forwards = [f for f in ("ref_forward", "reward_forward", "actor_forward", "critic_forward") if f not in left_out]
    checkpointed = ["actor_train"] + (["critic_train"] if critic else [])  # a checkpoint holds each one's part
    trainers = checkpointed + (["medusa_train"] if cfg.rollout.medusa.enabled and cfg.rollout.medusa.companion else [])
    parts = {"ref_forward": "ref_logp", "reward_forward": "reward", "actor_forward": "old_logp",
             "critic_forward": "values"}
    prefetch = vision_language and cfg.vision.prefetch
    topics = {**{parts[f]: TopicConfig(producers=[f]) for f in forwards}}
    if not vision_language:
        topics.update(
            prompts=TopicConfig(producers=["prompts"], consumers=["rollout"]),
            rollout=TopicConfig(producers=["rollout"], consumers=forwards),
            experience=TopicConfig(join=["rollout", *(parts[f] for f in forwards)], consumers=trainers,
                                   align_at_stop=checkpointed),
        )
    else:
        images = "vision" if prefetch else "prompts"  # the handle every stage reads image features from
        topics.update(
            prompts=TopicConfig(producers=["prompts"], consumers=["vision_prefetch" if prefetch else "rollout"]),
            rollout=TopicConfig(producers=["rollout"]),
            generated=TopicConfig(join=["rollout", images], consumers=forwards),
            experience=TopicConfig(join=["rollout", images, *(parts[f] for f in forwards)], consumers=trainers,
                                   align_at_stop=checkpointed),
        )
        if prefetch:
            topics["vision"] = TopicConfig(producers=["vision_prefetch"], consumers=["rollout"],
                                           capacity=cfg.vision.prefetch_depth)
    job = JobContext(cfg, checkpoint, weights_root, vision_language, resume)
    minibatches = cfg.rollout_batch.minibatches
    trace = f"{cfg.run_dir}/{TRACE_FOLDER}" if cfg.trace else None
    names = ["prompts", *(["vision_prefetch"] if prefetch else []), "rollout", *forwards, *trainers]
    if unused := [stage for stage in cfg.placement.with_rollout if stage not in names]:
        log.info("placement.with_rollout: %s not in this job", ", ".join(unused))
    ranks = check_placement(cfg, names)
    groups = device_groups(cfg, names)
    grouped = {member for members in groups.values() for member in members}
    stages = _lend_idle_cores(cfg, {name: _stage_spec(cfg, name, job, ranks[name], trace, name in grouped)
                                    for name in names})
    # a whole iteration must fit in the queues, or the sync barriers (and the trainers, which
    # wait for every mini-batch of an iteration) would stall on back-pressure
    capacity = max(cfg.broker.queue_capacity, 2 * minibatches * (cfg.overlap_depth + 1))
    broker = replace(cfg.broker, queue_capacity=capacity)
    warmup = cfg.critic.warmup_iterations if cfg.algorithm.uses_critic else 0
    overlap = OverlapAdmission(frozenset({"prompts"}), cfg.overlap_depth, job.start_version, warmup)
    admission = overlap if cfg.schedule == "stream" else PhaseAdmission(
        overlap, frozenset({"generated" if vision_language else "rollout", "experience"}), minibatches
    )
    placement = cfg.placement
    broker_cores = placement.broker_cores or placement.mode_cores(rollout_side=False)
    return Dataflow(Topology(topics), broker, stages, admission, broker_cores, left_out, trace, groups)


def check_placement(cfg: RLJobConfig, stages: list[str] | None = None) -> dict[str, list[RankPlacement]]:
    """The ranks of each of `stages` (default: every stage the config could have), checked against
    this machine; the driver calls it before the warm start, so a bad placement costs nothing."""
    names = stages if stages is not None else list(STAGE_KINDS)
    ranks = {name: stage_ranks(cfg.placement, name, on_rollout_cores(cfg, name), _uses_device(cfg, name))
             for name in names}
    preflight(cfg.placement, ranks)
    return ranks


def device_groups(cfg: RLJobConfig, stages: list[str]) -> dict[str, list[str]]:
    """`placement.device_groups` among the stages this job has: a member the config leaves out is
    dropped (logged), and a group left with one stage is that stage alone."""
    groups = {}
    for name, members in cfg.placement.device_groups.items():
        kept = [m for m in members if m in stages]
        if len(kept) < len(members):
            log.warning("placement.device_groups.%s: %s not in this job (left out or not configured)%s", name,
                        ", ".join(m for m in members if m not in stages),
                        "" if len(kept) > 1 else f"; {kept[0] if kept else 'nothing'} runs on its own")
        if len(kept) > 1:
            groups[name] = kept
    return groups


def offload_policy(cfg: RLJobConfig, stage: str, grouped: bool) -> OffloadPolicy | None:
    """The stage's `offload` (a device-group member without one moves everything it holds when
    another takes the device); a trainer computes only in the step that completes its iteration,
    so for it `iteration` is `step`."""
    own = cfg.placement.stages.get(stage)
    policy = own.offload if own is not None else None
    kind = STAGE_KINDS[stage]
    if policy is None and grouped and kind.groupable:
        policy = default_group_policy(trains=kind.trains)
    if policy is not None and policy.when == "iteration" and kind.trains:
        policy = replace(policy, when="step")
    return policy


def _stage_spec(cfg: RLJobConfig, name: str, job: JobContext, ranks: list[RankPlacement],
                trace: str | None, grouped: bool = False) -> StageSpec:
    return StageSpec(
        STAGE_KINDS[name].cls,
        instances=_instances(cfg, name),
        kwargs={"job": job},
        cores=ranks[0].cores,
        threads=ranks[0].threads,
        restarts=cfg.restarts_of(name),
        trace=trace,
        ranks=len(ranks),
        devices=[r.device for r in ranks],
        rank_cores=[r.cores for r in ranks],
        group_timeout_s=cfg.timeout_s,
        offload=offload_policy(cfg, name, grouped),
        last_minibatch=cfg.rollout_batch.minibatches - 1,
        counts_dir=cfg.run_dir,
    )


OFF_BOARD = frozenset({"prompts"})
"""Stages that never borrow or lend cores (no slot on the core board)."""


def lends_idle_cores(cfg: RLJobConfig) -> bool:
    """Whether the job's sides lend each other idle cores: `placement.lend_idle_cores` with a
    separated placement on the CPU whose sides have no core in common, under the local launcher
    (the core board is a folder of this machine)."""
    placement = cfg.placement
    return (placement.lend_idle_cores and placement.mode == "separated" and placement.resolved_device() == "cpu"
            and not set(placement.rollout_cores) & set(placement.train_cores) and cfg.launcher == "local")


def _lend_idle_cores(cfg: RLJobConfig, stages: dict[str, StageSpec]) -> dict[str, StageSpec]:
    """When the job lends idle cores (`lends_idle_cores`), every one-rank stage on its side's cores
    (`OFF_BOARD` aside) borrows the other side's while it is the only one in a step; each instance
    gets a slot of the run's core board."""
    placement = cfg.placement
    sides = (set(placement.rollout_cores), set(placement.train_cores))
    if not lends_idle_cores(cfg):
        return stages
    grouped = {member for members in cfg.placement.device_groups.values() for member in members}
    rollout_side = {name: on_rollout_cores(cfg, name) for name, spec in stages.items()  # on its side's cores, one rank
                    if name not in OFF_BOARD and spec.ranks == 1 and name not in grouped
                    and set(spec.cores or ()) == sides[not on_rollout_cores(cfg, name)]}
    if len(set(rollout_side.values())) < 2:  # nothing to lend to the other side
        return stages
    first, total = {}, 0
    for name in rollout_side:
        first[name], total = total, total + stages[name].instances
    board = str(Path(cfg.run_dir) / "core_board")
    lent = dict(stages)
    for name, side in rollout_side.items():
        lender_cores = tuple(placement.train_cores if side else placement.rollout_cores)
        lent[name] = replace(stages[name], lending=CoreLending(board, total, first[name], lender_cores))
    return lent


def on_rollout_cores(cfg: RLJobConfig, stage: str) -> bool:
    """The stage runs on the rollout side's cores when separated (`ROLLOUT_SIDE`, `placement.with_rollout`)."""
    return stage in ROLLOUT_SIDE or stage in cfg.placement.with_rollout


def _uses_device(cfg: RLJobConfig, stage: str) -> bool:
    """The stage keeps a torch model on its rank's device (vLLM places its own engine)."""
    return stage not in NO_MODEL and not (stage == "rollout" and cfg.rollout.backend == "vllm")


def _instances(cfg: RLJobConfig, stage: str) -> int:
    return {"rollout": cfg.rollout.instances, "vision_prefetch": cfg.vision.instances}.get(stage, 1)
