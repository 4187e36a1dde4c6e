"""What the handle of each RL topic carries: one typed schema per topic, checked at publish.

    return [topic_output("reward", {"scores": scores}, batch.num_samples)]   # an Output, checked
    TOPICS["rollout"].check(tensors, num_samples)                            # raises TopicSchemaError

Every RL stage builds its outputs with `topic_output`, so a stage that renames, drops, adds or
mistypes a field fails where it publishes, naming the topic and the field, instead of in a
consumer several processes away. Field kinds:

    per_sample   (N, ...)                 one entry per sample of the handle
    ragged       (sum R_i, ...) + `<name>_lens` (N,) int32 summing to it (`samples.ragged`)
    free         any first dimension      (per image, per image token)

Joined topics (`generated`, `experience`) are the broker's unions of these; their stages read
the parts by these names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from stream_rlhf.stage import Output

REWARD_KWARGS = "reward_kwargs"
"""Handle metadata (prompts, vision, rollout): each sample's extra keyword arguments of the reward
function (`data.fields`) as a JSON object's text, since handle metadata holds scalars and lists
of them."""
Kind = Literal["per_sample", "ragged", "free"]
INT = (torch.int64,)
FLOAT = (torch.float32,)
BOOL = (torch.bool,)


class TopicSchemaError(ValueError):
    """An output that does not match its topic's schema (names the topic and the field)."""


@dataclass(frozen=True)
class Field:
    name: str
    kind: Kind
    dtypes: tuple[torch.dtype, ...]
    optional: bool = False
    """May be absent (a vision-language model's fields, in-flight weight updates' token versions)."""


@dataclass(frozen=True)
class TopicSchema:
    topic: str
    fields: tuple[Field, ...]

    def names(self) -> set[str]:
        return {f.name for f in self.fields} | {f"{f.name}_lens" for f in self.fields if f.kind == "ragged"}

    def check(self, tensors: dict[str, Tensor], num_samples: int) -> None:
        unknown = sorted(set(tensors) - self.names())
        if unknown:
            raise TopicSchemaError(f"topic {self.topic!r}: fields {unknown} are not in its schema "
                                   f"(stream_rlhf/stages/topics.py: {sorted(self.names())})")
        for field in self.fields:
            if field.name not in tensors:
                if not field.optional:
                    raise TopicSchemaError(f"topic {self.topic!r}: field {field.name!r} is missing")
                continue
            self._check_field(field, tensors, num_samples)

    def _check_field(self, field: Field, tensors: dict[str, Tensor], num_samples: int) -> None:
        where = f"topic {self.topic!r}: field {field.name!r}"
        value = tensors[field.name]
        if not isinstance(value, Tensor):
            raise TopicSchemaError(f"{where}: a {type(value).__name__}, not a tensor")
        if value.dtype not in field.dtypes:
            raise TopicSchemaError(f"{where}: dtype {value.dtype}, expected {' or '.join(map(str, field.dtypes))}")
        if field.kind == "per_sample" and (value.dim() == 0 or value.shape[0] != num_samples):
            raise TopicSchemaError(f"{where}: shape {tuple(value.shape)}, expected ({num_samples}, ...) "
                                   "(one entry per sample)")
        if field.kind == "ragged":
            lens = tensors.get(f"{field.name}_lens")
            if lens is None or lens.dtype != torch.int32 or lens.shape != (num_samples,):
                got = "missing" if lens is None else f"{lens.dtype} {tuple(lens.shape)}"
                raise TopicSchemaError(f"{where}_lens: {got}, expected int32 ({num_samples},)")
            if value.dim() == 0 or int(lens.sum()) != value.shape[0]:
                raise TopicSchemaError(f"{where}: {tuple(value.shape)} values for lengths summing to {int(lens.sum())}")


IMAGE_FIELDS = (Field("image_grid_thw", "free", INT, optional=True),
                Field("prompt_images", "ragged", INT, optional=True))
PROMPT = (Field("prompt_ids", "ragged", INT), Field("group_ids", "per_sample", INT))
TOPICS = {schema.topic: schema for schema in (
    TopicSchema("prompts", (*PROMPT, *IMAGE_FIELDS, Field("pixel_values", "free", FLOAT, optional=True))),
    TopicSchema("vision", (*PROMPT, *IMAGE_FIELDS, Field("image_features", "free", FLOAT),
                           Field("image_tokens", "free", INT))),
    TopicSchema("rollout", (
        Field("sequences", "ragged", INT), Field("behavior_logp", "ragged", FLOAT),
        Field("prompt_lens", "per_sample", (torch.int32,)),
        Field("group_ids", "per_sample", INT, optional=True),  # a VLM's come with the image handle
        Field("token_versions", "ragged", (torch.int32,), optional=True),  # in-flight updates; env: -1 on observations
        Field("loss_mask", "ragged", BOOL, optional=True),  # env: True on policy tokens, False on observations
        Field("env_rewards", "ragged", FLOAT, optional=True),  # env: each turn's reward on its last policy token
        Field("trained", "per_sample", BOOL, optional=True),  # env.failed_episodes=mask: False for a failed episode
        Field("truncated", "per_sample", BOOL, optional=True),  # cut by the length limit (algorithm.mask_truncated)
        # env, a VLM: each episode's observation images after its prompt's (envs/episode_handle.py)
        Field("episode_image_features", "ragged", FLOAT, optional=True),
        Field("episode_image_grid_thw", "ragged", INT, optional=True),
    )),
    TopicSchema("ref_logp", (Field("ref_logp", "ragged", FLOAT),)),
    TopicSchema("old_logp", (Field("old_logp", "ragged", FLOAT),)),
    TopicSchema("values", (Field("values", "ragged", FLOAT),)),
    TopicSchema("reward", (Field("scores", "per_sample", FLOAT),
                           Field("process_rewards", "ragged", FLOAT, optional=True))),  # reward.process
)}


def topic_output(topic: str, tensors: dict[str, Tensor], num_samples: int, *args: Any, **kwargs: Any) -> Output:
    """`Output(topic, tensors, num_samples, ...)` once `tensors` match the topic's schema."""
    if topic not in TOPICS:
        raise TopicSchemaError(f"topic {topic!r}: no schema (stream_rlhf/stages/topics.py has {sorted(TOPICS)})")
    TOPICS[topic].check(tensors, num_samples)
    return Output(topic, tensors, num_samples, *args, **kwargs)
