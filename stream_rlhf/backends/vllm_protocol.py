"""The messages between a rollout instance (`vllm_client.py`) and its vLLM engine process
(`vllm_server.py`): typed msgpack over one ZeroMQ PAIR socket, never pickle.

    client                                   engine process
      | ---------- (process start) --------> |  builds the engine (seconds)
      | <------------- Ready ---------------- |
      | ------------- Generate -------------> |  continuous batching over the prompts
      | ------------- Update ---------------> |  (in flight: applied between engine steps)
      | <------------- Done ----------------- |
      | <------------ Generated ------------- |
      | ---- Update / Call / Sleep / WakeUp -> |
      | <------------- Done ----------------- |
      | ----------- SubmitTurns ------------> |  multi-turn episodes: requests added, the
      | <------------- Done ----------------- |  engine steps them between requests
      | ------------ PollTurns --------------> |  waits up to its timeout for turns to end
      | <------------ TurnsDone ------------- |
      | ----------- AbortTurns -------------> |
      | <------------- Done ----------------- |
      | ------------- Close ----------------> |  engine shut down, process exits
      | <------------- Done ----------------- |
      any request can be answered by Failed(traceback) instead.

Token ids and log-probs travel as flat little-endian int32 / float32 bytes plus per-sample
lengths; a vision-language model's prompts carry their image features the same way
(`PromptImages`), and a text model's carry none (the field is left out of the message).
Multi-turn episodes (`vllm_turns.py`) send each policy turn as a request of its own
(SubmitTurns, named by the client's request ids); the engine process steps them whenever no
message is waiting, so generation goes on while the client is busy with tools, and PollTurns
collects the turns that ended. Update is allowed between them.
`Update.method` names a `WeightSyncExtension` method of the workers (`vllm_worker.py`) and `args`
are plain values (names, numbers, JSON): weights never travel through this socket. The workers
join the trainer's weight transport once (`Call(JOIN, ...)`), and each weight update is then
`receive_update(version)`: receive the newest version >= it through that transport, load it.
"""

from __future__ import annotations

import msgspec

Arg = str | int | float


class PromptImages(msgspec.Struct, frozen=True):
    """The images of one prompt, already encoded by the vision tower (a `SampleImages`)."""

    features: bytes
    """float32 (rows, hidden): one row per image token of the prompt, image after image."""
    rows: int
    hidden: int
    grid_thw: list[list[int]]
    """(t, h, w) of each image in vision patches, in prompt order ([] for a prompt without images)."""


class Generate(msgspec.Struct, tag="generate", frozen=True, omit_defaults=True):
    prompt_ids: bytes
    """int32 token ids of every prompt, concatenated."""
    prompt_lens: list[int]
    seeds: list[int]
    temperature: float
    top_p: float
    max_new_tokens: int
    stop_token_ids: list[int]
    images: list[PromptImages] | None = None
    """One per prompt for a vision-language model; None (not sent) for a text model."""


class SubmitTurns(msgspec.Struct, tag="submit_turns", frozen=True, omit_defaults=True):
    """Start one request per policy turn; answered by Done at once (the engine does not wait for them)."""

    request_ids: list[str]
    prompt_ids: bytes
    """int32 token ids of every turn's context (the episode so far), concatenated."""
    prompt_lens: list[int]
    seeds: list[int]
    max_new_tokens: list[int]
    """Each turn's budget."""
    temperature: float
    top_p: float
    stop_token_ids: list[int]
    images: list[PromptImages] | None = None
    """One per turn for a vision-language model (its episode's prompt images); None for a text model."""
    stop_strings: list[str] = []
    """Text that ends a turn at the token completing it (env.stop_strings)."""


class PollTurns(msgspec.Struct, tag="poll_turns", frozen=True):
    """Answered by TurnsDone as soon as a turn has ended, or after `timeout_s` (at the next engine
    step's end), or at once when no turn runs."""

    timeout_s: float


class AbortTurns(msgspec.Struct, tag="abort_turns", frozen=True):
    """Drop these turns, running or ended and not yet collected; answered by Done."""

    request_ids: list[str]


JOIN = "srl_join"
"""The workers' method joining a weight transport: (transport, Link as JSON, group, world size)."""
RECEIVE = "srl_receive"
"""The workers' method receiving a version >= its one argument through the joined transport."""


class Update(msgspec.Struct, tag="update", frozen=True):
    version: int
    method: str
    args: list[Arg]


def receive_update(version: int) -> Update:
    """The update that brings the engine to the newest version >= `version` of its transport."""
    return Update(version, RECEIVE, [version])


class Call(msgspec.Struct, tag="call", frozen=True):
    """Call a worker method that loads no weights (joining the trainer's group)."""

    method: str
    args: list[Arg]


class Sleep(msgspec.Struct, tag="sleep", frozen=True):
    pass


class WakeUp(msgspec.Struct, tag="wake_up", frozen=True):
    update: Update | None = None
    """Loaded after the weights wake and before the KV cache does."""


class Close(msgspec.Struct, tag="close", frozen=True):
    pass


class Ready(msgspec.Struct, tag="ready", frozen=True):
    pid: int


class Generated(msgspec.Struct, tag="generated", frozen=True):
    response_ids: bytes
    """int32, every response concatenated."""
    response_logp: bytes
    """float32 behaviour log-prob of each response token."""
    token_versions: bytes
    """int32 weight version that sampled each response token."""
    response_lens: list[int]
    finish_reasons: list[str]


class TurnsDone(msgspec.Struct, tag="turns_done", frozen=True):
    """The turns that ended since the last PollTurns, in `generated`'s order."""

    request_ids: list[str]
    generated: Generated
    cached_tokens: list[int]
    """Context tokens of each turn found in the prefix cache (not computed again)."""


class Done(msgspec.Struct, tag="done", frozen=True):
    version: int
    """The weight version the engine holds now."""


class Failed(msgspec.Struct, tag="failed", frozen=True):
    message: str


Request = Generate | Update | Call | Sleep | WakeUp | Close | SubmitTurns | PollTurns | AbortTurns
Reply = Ready | Generated | Done | Failed | TurnsDone
request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)
encoder = msgspec.msgpack.Encoder()
