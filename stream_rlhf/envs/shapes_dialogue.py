"""Two questions about one image (`task.name: shapes_dialogue`, configs/mllm_multiturn_ppo.yaml):
the second asks about the colour the policy named in its first answer, and each turn has its
own reward.

    prompt      <image>color at 2 3?
    policy      red<eos>                 reward shapes.reward vs the square's colour: 1.0, 0.1 or 0
    observation how many red?            about the colour the policy named, right or wrong
    policy      2<eos>                   reward vs the number of red squares in the image; done

A first answer that is no colour word ends the episode after its turn (there is nothing to ask
about). The squares are read from the episode's image (`shapes.read_squares`), so the dataset
needs no extra columns.
"""

from __future__ import annotations

from collections.abc import Sequence

from stream_rlhf.data import shapes
from stream_rlhf.data.shapes_dialogue import Squares, count_of, follow_up
from stream_rlhf.envs.environment import EpisodeStart, Observation, Turn


class ShapesDialogue:
    """One episode of the two-question shapes task (see the module docstring)."""

    def __init__(self) -> None:
        self.start: EpisodeStart | None = None
        self.squares: Squares = ()
        self.turns = 0
        """Policy turns answered so far."""
        self.question: str = ""
        """The question the policy is answering now."""
        self.reference: str = ""
        """Its right answer."""

    def reset(self, start: EpisodeStart) -> None:
        if len(start.images) != 1:
            raise ValueError(f"expected one image per episode, got {len(start.images)}")
        self.start = start
        self.squares = shapes.read_squares(start.images[0])
        self.turns = 0
        self.question, self.reference = start.prompt, start.reference

    def step(self, text: str, token_ids: Sequence[int]) -> Turn:
        if self.start is None:
            raise RuntimeError("step before reset")
        answer = text.strip()
        reward = shapes.reward(self.question, answer, self.reference)
        self.turns += 1
        if self.turns > 1 or answer not in shapes.COLORS:
            return Turn(None, reward, done=True)
        self.question, self.reference = follow_up(answer), str(count_of(self.squares, answer))
        return Turn(Observation(self.question), reward)
