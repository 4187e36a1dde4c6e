"""A chat message after an assistant turn, as the ids a chat template writes around its content:
what an environment's observation with a role (`Observation.role: tool`) becomes in an episode.

    frames = MessageFrames.of(tokenizer, cfg.data.chat_template)   # or MessageFrames(tokenizer, template)
    before, after = frames.around("tool", last_token)      # ids around the observation's content
    ids = before + content_ids + after

Each role is rendered once: the template writes the conversation user, assistant, <role> (the
role's content a placeholder) with the generation prompt. `before` is what the template writes
after the assistant turn's end-of-turn token up to the content (ChatML: "\\n<|im_start|>tool\\n";
a template may wrap a tool's answer, as Qwen2.5's `<tool_response>` does), `after` the rest, up to
and including the next assistant turn's header ("<|im_end|>\\n<|im_start|>assistant\\n"). So an
episode reads as `apply_chat_template` writes the whole conversation, token for token, wherever
the content's own tokens split as they would there. A policy turn that ended without the
end-of-turn token (cut by a length limit, or at another stop token) gets it first, as the template
would have closed the turn. ValueError (the episode fails as "malformed") for a job without a chat
template, or a role the template refuses or does not write as given.
"""

from __future__ import annotations

from functools import cached_property

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from stream_rlhf.data.chat_template import end_of_turn_id, resolve_chat_template

ASSISTANT_TEXT = "assistant text"
"""Stands for the assistant turn the message follows (its own ids are the policy's)."""
CONTENT = "observation content"
"""Stands for the message's content while the template renders its frame."""


class MessageFrames:
    """The ids before and after a message's content, per role; see the module docstring."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, template: str | None):
        self.tokenizer, self.template = tokenizer, template
        self.frames: dict[str, tuple[list[int], list[int]]] = {}

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase, setting: str) -> MessageFrames:
        """The frames of a `data.chat_template` setting (auto, none or a template file)."""
        return cls(tokenizer, resolve_chat_template(setting, tokenizer))

    @cached_property
    def end_of_turn(self) -> int | None:
        """The token the template closes an assistant turn with (found at the first message)."""
        return end_of_turn_id(self.tokenizer, self.template)

    def around(self, role: str, last_token: int | None) -> tuple[list[int], list[int]]:
        """(before, after) of a `role` message after a policy turn whose last token is `last_token`."""
        if role not in self.frames:
            self.frames[role] = self._render(role)
        before, after = self.frames[role]
        if self.end_of_turn is not None and last_token != self.end_of_turn:
            before = [self.end_of_turn, *before]
        return before, after

    def _render(self, role: str) -> tuple[list[int], list[int]]:
        if self.template is None:
            raise ValueError(f"Observation.role={role!r}: needs a chat template (data.chat_template is none, or "
                             "auto and the tokenizer has none)")
        turns = [{"role": "user", "content": "question"}, {"role": "assistant", "content": ASSISTANT_TEXT},
                 {"role": role, "content": CONTENT}]
        try:
            text = self.tokenizer.apply_chat_template(turns, chat_template=self.template, add_generation_prompt=True,
                                                      tokenize=False)
        except TemplateError as error:
            raise ValueError(f"Observation.role={role!r}: the chat template cannot write such a message "
                             f"({error})") from None
        if text.count(ASSISTANT_TEXT) != 1 or text.count(CONTENT) != 1:
            raise ValueError(f"Observation.role={role!r}: the chat template does not write the assistant turn and "
                             "the message's content as given")
        between, after = text.split(ASSISTANT_TEXT)[1].split(CONTENT)
        if self.end_of_turn is not None:
            closing = self.tokenizer.decode([self.end_of_turn])
            if not between.startswith(closing):
                raise ValueError(f"Observation.role={role!r}: the chat template does not close the assistant turn "
                                 f"with {closing!r} before the message")
            between = between[len(closing):]
        encode = self.tokenizer.encode
        return encode(between, add_special_tokens=False), encode(after, add_special_tokens=False)
