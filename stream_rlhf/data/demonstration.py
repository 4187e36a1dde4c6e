"""Demonstrations of the SFT warm start: what follows a prompt, as turns, and which of them the
model is trained on.

    single = answer_only("42")                                   # a one-turn task: the answer, trained
    episode = (policy("calc:123+456+789"), observation("=1368"), policy("1368"))
    ids, labels = demonstration_rows(tokenizer, prompt_ids, episode)

A policy turn is trained on (its tokens and the eos that ends it, as the policy samples a turn); an
observation (what an environment appends, envs/environment.py) is in the input but carries no loss
(label -100), as in RL, where its loss mask is 0. Texts are encoded without special tokens, as the
episode loop encodes observations; the policy's turns end with the eos it stops at.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

IGNORE = -100
"""The label of a token that carries no loss (the prompt, observations, padding)."""


@dataclass(frozen=True)
class Segment:
    """One turn of a demonstration."""

    text: str
    trained: bool
    """True: a policy turn (its tokens and the eos after them carry loss); False: an observation."""


def policy(text: str) -> Segment:
    return Segment(text, trained=True)


def observation(text: str) -> Segment:
    return Segment(text, trained=False)


def answer_only(answer: str) -> tuple[Segment, ...]:
    """The demonstration of a single-turn task: the reference answer, one policy turn."""
    return (policy(answer),)


def demonstration_rows(tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int],
                       segments: tuple[Segment, ...]) -> tuple[list[int], list[int]]:
    """(input ids, labels) of one demonstration: the prompt, then each segment's tokens (a policy
    turn's followed by the eos); labels are the ids on policy tokens and IGNORE elsewhere."""
    ids, labels = list(prompt_ids), [IGNORE] * len(prompt_ids)
    for segment in segments:
        encoded = tokenizer.encode(segment.text, add_special_tokens=False)
        if segment.trained:
            encoded = [*encoded, tokenizer.eos_token_id]
        ids += encoded
        labels += encoded if segment.trained else [IGNORE] * len(encoded)
    return ids, labels
