"""Stop strings of policy turns (`env.stop_strings`) for the torch turn sampler: a turn ends at the
token whose text completes one of them, as vLLM's stop strings end a request there.

    stop = TurnStop(("</search>", "</code>"), decode)   # decode: ids -> text, without special tokens
    stop(turn_ids)                                       # after each sampled token: does it end the turn?

The sampler asks after every token, so a string found in the turn's text was completed by its last
token. Only the last few tokens are decoded (the longest string's length in characters, a token
writes at least one, plus two for a tokenizer that writes a word's leading space only after another
token): the check costs one short decode per episode and token (about 4 us with the project's
tokenizer on one core of the 2-core CPU: 0.5 ms per step of 128 episodes). The turn keeps all its tokens,
the completing one whole (a token is never split): text after the string in that token stays.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

CONTEXT_TOKENS = 2
"""Tokens decoded before the longest string's worth, so that its first character decodes as in context."""


class TurnStop:
    """Whether a turn's last token completed one of `strings` (see the module docstring)."""

    def __init__(self, strings: Sequence[str], decode: Callable[[list[int]], str]):
        if not strings or not all(strings):
            raise ValueError(f"TurnStop: stop strings must be non-empty, got {list(strings)!r}")
        self.strings, self.decode = tuple(strings), decode
        self.window = max(len(s) for s in self.strings) + CONTEXT_TOKENS

    def __call__(self, turn_ids: list[int]) -> bool:
        tail = self.decode(turn_ids[-self.window:])
        return any(s in tail for s in self.strings)
