"""The join rule: the parts of one (iteration, minibatch) merged into one handle.

`experience = join(rollout, ref_logp, reward, values, old_logp)` in a topology publishes, once a
handle of every part topic has arrived for the same (iteration, minibatch), one handle whose
fields point at the parts' payloads (no bytes move). The parts stay alive until the joined handle
is acknowledged by every consumer.
"""

from __future__ import annotations

import uuid

from stream_rlhf.broker.control.messages import FieldSpec, Handle


def merge_parts(join: str, parts: list[Handle]) -> tuple[Handle, int]:
    """One handle of topic `join` with every part's fields, in join order; a field name already
    taken is prefixed with its part's topic (`ref_logp.logp`). Metadata: the first part having a
    key wins. Routing fields come from the first part. Returns the handle and the collisions."""
    fields: dict[str, FieldSpec] = {}
    metadata = {}
    collisions = 0
    for part in parts:
        for name, spec in part.fields.items():
            if name in fields:
                collisions += 1
                name = f"{part.topic}.{name}"
            fields[name] = spec
        for key, value in part.metadata.items():
            metadata.setdefault(key, value)
    first = parts[0]
    joined = Handle(
        id=str(uuid.uuid5(uuid.NAMESPACE_OID, f"{join}/" + "/".join(p.id for p in parts))),
        topic=join,
        iteration=first.iteration,
        minibatch=first.minibatch,
        policy_version=first.policy_version,
        num_samples=first.num_samples,
        fields=fields,
        metadata=metadata,
        producer="broker",
        parents=[p.id for p in parts],
    )
    return joined, collisions
