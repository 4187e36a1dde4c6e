"""Long observations cut to `env.max_observation_tokens`, so that one tool that prints too much
(a stack trace, a whole file) shortens its observation instead of ending the episode at
`env.max_episode_tokens`.

    cut = ObservationCut(cfg, encode)        # cfg: the EnvConfig; encode: text -> token ids
    ids, was_cut = cut(encode(observation.text))

`env.observation_cut` says which part goes: `end` keeps the first tokens, `start` the last, and
`middle` the first and the last halves (the head gets the odd token). The tokens of
`env.observation_cut_marker` go where the cut was and count within the limit, so a cut observation
has exactly `max_observation_tokens` tokens. The cut is made on an observation's own tokens, before
its chat frame is put around it (the frame is never cut); an observation with images is not cut
(an image's pad run must stay whole).
"""

from __future__ import annotations

from collections.abc import Callable

from stream_rlhf.config import ConfigError
from stream_rlhf.envs.config import EnvConfig


class ObservationCut:
    """Cuts an observation's ids to the limit (see the module docstring); the identity without one."""

    def __init__(self, cfg: EnvConfig, encode: Callable[[str], list[int]]):
        """ConfigError when the marker alone takes the whole limit."""
        self.limit, self.where = cfg.max_observation_tokens, cfg.observation_cut
        self.marker = encode(cfg.observation_cut_marker) if self.limit and cfg.observation_cut_marker else []
        if self.limit is not None and len(self.marker) >= self.limit:
            raise ConfigError(f"env.observation_cut_marker={cfg.observation_cut_marker!r} is {len(self.marker)} "
                              f"tokens, which leaves nothing of env.max_observation_tokens={self.limit}")

    def __call__(self, ids: list[int]) -> tuple[list[int], bool]:
        """`ids` cut to the limit, and whether they were."""
        if self.limit is None or len(ids) <= self.limit:
            return ids, False
        keep = self.limit - len(self.marker)
        if self.where == "end":
            return ids[:keep] + self.marker, True
        if self.where == "start":
            return self.marker + ids[len(ids) - keep:], True
        head = (keep + 1) // 2
        return ids[:head] + self.marker + ids[len(ids) - (keep - head):], True
