"""Chat messages after an assistant turn, as the ids a chat template writes around their contents:
what an environment's observations with a role (`Observation.role: tool`) become in an episode.

    frames = MessageFrames.of(tokenizer, cfg.data.chat_template)   # or MessageFrames(tokenizer, template)
    pieces = frames.around(("tool", "tool"), last_token)   # n + 1 pieces of ids around n contents
    ids = pieces[0] + first + pieces[1] + second + pieces[2]

Each run of roles is rendered once: the template writes the conversation user, assistant, then
the messages (their contents placeholders) with the generation prompt. The first piece is what
the template writes after the assistant turn's end-of-turn token up to the first content (ChatML:
"\n<|im_start|>tool\n"; a template may wrap a tool's answer, as Qwen2.5's `<tool_response>`
does, and group consecutive tool messages in one turn), the middle ones what it writes between
two contents, the last the rest, up to and including the next assistant turn's header
("<|im_end|>\n<|im_start|>assistant\n"). So an episode reads as `apply_chat_template` writes the
whole conversation, token for token, wherever the contents' own tokens split as they would
there. A policy turn that ended without the end-of-turn token (cut by a length limit, or at
another stop token) gets it first, as the template would have closed the turn. ValueError (the
episode fails as "malformed") for a job without a chat template, or roles the template refuses or
does not write as given.
"""

from __future__ import annotations

from functools import cached_property

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from stream_rlhf.data.chat_template import end_of_turn_id, resolve_chat_template

ASSISTANT_TEXT = "assistant text"
"""Stands for the assistant turn the message follows (its own ids are the policy's)."""
CONTENT = "observation {} content"
"""Stands for message k's content while the template renders the frame."""


class MessageFrames:
    """The ids around messages' contents, per run of roles; see the module docstring."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, template: str | None):
        self.tokenizer, self.template = tokenizer, template
        self.frames: dict[tuple[str, ...], list[list[int]]] = {}

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase, setting: str) -> MessageFrames:
        """The frames of a `data.chat_template` setting (auto, none or a template file)."""
        return cls(tokenizer, resolve_chat_template(setting, tokenizer))

    @cached_property
    def end_of_turn(self) -> int | None:
        """The token the template closes an assistant turn with (found at the first message)."""
        return end_of_turn_id(self.tokenizer, self.template)

    def around(self, roles: tuple[str, ...], last_token: int | None) -> list[list[int]]:
        """The len(roles) + 1 pieces of ids around the contents of messages of `roles`, after a
        policy turn whose last token is `last_token`."""
        if roles not in self.frames:
            self.frames[roles] = self._render(roles)
        first, *rest = self.frames[roles]
        if self.end_of_turn is not None and last_token != self.end_of_turn:
            first = [self.end_of_turn, *first]
        return [first, *rest]

    def _render(self, roles: tuple[str, ...]) -> list[list[int]]:
        named = ", ".join(repr(role) for role in roles)
        if self.template is None:
            raise ValueError(f"Observation.role={named}: needs a chat template (data.chat_template is none, or "
                             "auto and the tokenizer has none)")
        contents = [CONTENT.format(k) for k in range(len(roles))]
        turns = [{"role": "user", "content": "question"}, {"role": "assistant", "content": ASSISTANT_TEXT},
                 *({"role": role, "content": content} for role, content in zip(roles, contents))]
        try:
            text = self.tokenizer.apply_chat_template(turns, chat_template=self.template, add_generation_prompt=True,
                                                      tokenize=False)
        except TemplateError as error:
            raise ValueError(f"Observation.role={named}: the chat template cannot write such messages "
                             f"({error})") from None
        if text.count(ASSISTANT_TEXT) != 1 or any(text.count(content) != 1 for content in contents):
            raise ValueError(f"Observation.role={named}: the chat template does not write the assistant turn and "
                             "the messages' contents as given")
        pieces = [text.split(ASSISTANT_TEXT)[1]]
        for content in contents:
            pieces[-1:] = pieces[-1].split(content)
        if self.end_of_turn is not None:
            closing = self.tokenizer.decode([self.end_of_turn])
            if not pieces[0].startswith(closing):
                raise ValueError(f"Observation.role={named}: the chat template does not close the assistant turn "
                                 f"with {closing!r} before the messages")
            pieces[0] = pieces[0][len(closing):]
        return [self.tokenizer.encode(piece, add_special_tokens=False) if piece else [] for piece in pieces]
