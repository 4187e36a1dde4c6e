"""Config of the environment of multi-turn / tool-using episodes (`env`), beside the code that
runs it (`stepper.py`, `episode.py`).

    env:
      factory: stream_rlhf.envs.calculator:Calculator   # one environment per episode
      options: {latency_s: 0.05}                         # keyword arguments of the factory
      max_turns: 4
      max_episode_tokens: 256
      max_observation_tokens: 64                         # a longer tool result is cut (observation_cut.py)
      step_timeout_s: 10
      schedule: stream                                   # or lockstep (the baseline)
      minibatches_in_flight: 2                           # stream: episodes of 2 mini-batches at once
      tools: []                                          # functions the policy may call (tool_calls.py)
      processes: 0                                       # N: environments in N processes (process_envs.py)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from msgspec import Meta
from transformers.utils import get_json_schema

from stream_rlhf.config import ConfigError, check_fields, import_dotted
from stream_rlhf.envs.environment import Environment


@dataclass(frozen=True)
class EnvConfig:
    """The environment every episode of the job runs in, and the engine's limits on episodes."""

    factory: str
    """Dotted path "package.module:name" of a class or function that makes one environment
    (`reset` and `step`, sync or async: see envs/environment.py) from `options`."""
    options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of `factory`."""
    max_turns: Annotated[int, Meta(ge=1)] = 4
    """Policy turns per episode; the episode ends (reason max_turns) after the last."""
    max_episode_tokens: Annotated[int, Meta(ge=1)] = 512
    """Prompt, policy and observation tokens of one episode; it ends (reason max_episode_tokens)
    when a turn reaches the limit."""
    max_observation_images: Annotated[int, Meta(ge=0)] = 4
    """Images the observations of one episode may show in all (a vision-language policy); an
    observation that would pass it fails the episode as "malformed". rollout.backend=vllm takes
    data.max_images_per_prompt + this many images per turn."""
    max_observation_tokens: Annotated[int, Meta(ge=1)] | None = None
    """Tokens of one observation's text at most (one tool result: its chat frame comes on top); a
    longer one is cut (`observation_cut`, `envs/observation_cut.py`) instead of ending the episode
    at max_episode_tokens, and counted (metrics and summary.json `observations_cut`). null: no
    limit. An observation with images is not cut."""
    observation_cut: Literal["end", "start", "middle"] = "end"
    """Which part of a long observation goes: `end` keeps its first tokens, `start` its last,
    `middle` its first and last halves (a traceback's head and the error at its end)."""
    observation_cut_marker: str = " ..."
    """Text put where an observation was cut, so that the policy sees it was; its tokens count
    within max_observation_tokens ("" for none)."""
    stop_strings: list[str] = field(default_factory=list)
    """Text that ends a policy turn besides the stop tokens (`rollout.stop`): a base model's closing
    tag of a tool call (`</search>`, `</code>`), so that the environment answers as soon as the call
    is written instead of the policy going on to write the answer itself. The turn ends at the token
    whose text completes the string and keeps it whole (a token is never split); the torch sampler
    and vLLM stop at the same token."""
    failed_episodes: Literal["train", "mask"] = "train"
    """What training does with an episode that failed (its environment raised, timed out or
    answered something malformed). `train`: it is trained on like any other, with the turns it has
    and reward 0 for the failing turn. `mask`: its tokens carry no loss (no policy gradient, KL or
    value loss) and it takes no part in its prompt group's statistics (grpo, rloo), since a tool
    server that is down says nothing about the policy; it still counts as trained in the sample
    accounting, and as masked in metrics.jsonl (`episodes_masked`). Make an environment answer a
    policy's own mistake (a bad tool call) with an observation or a reward, not by raising."""
    step_timeout_s: Annotated[float, Meta(gt=0)] = 30.0
    """Seconds one reset or step may take; past it the episode fails with reason "timeout"."""
    schedule: Literal["stream", "lockstep"] = "stream"
    """`stream`: a turn goes to its environment as soon as it ends and the episode's next turn starts
    as soon as the environment answers, so rollout decodes for the others while one waits for its
    tool; `lockstep`: a synchronous engine (the baseline of bench/agentic.py): a mini-batch's turn-k
    environment calls start once all its turn-k generation has ended, and turn k+1 starts for all
    once the slowest call has returned."""
    minibatches_in_flight: Annotated[int, Meta(ge=1)] = 2
    """Under `stream`, how many mini-batches' episodes a rollout instance runs at once: while one
    mini-batch's episodes wait for their tools, the next one's decode in the same batch, and a
    mini-batch is published as soon as its own episodes end. Each one that joins loads the newest
    weights (its tokens, and those of turns then in progress, record the version that sampled
    them; vLLM loads them at the next turn boundary). `lockstep` runs one at a time."""
    tools: list[str] = field(default_factory=list)
    """Python functions the policy may call, by dotted path ("pkg.module:name"), each with type hints
    and a Google-style docstring (Args:) that describe it. Their JSON schemas go to the chat template
    with every prompt of a dataset (`tools=`, as `apply_chat_template` takes them), and the factory
    gets the functions as its `tools` keyword (`stream_rlhf.envs.tool_calls:ToolCalls` runs the
    calls it parses from each turn)."""
    processes: Annotated[int, Meta(ge=0)] = 0
    """0: environments live in the rollout process (sync calls in its threads). N: in N worker
    processes of their own, each episode's in one (`process_envs.py`): for environments whose work
    holds the GIL and would slow rollout's decode loop, or whose calls may hang (a worker with a
    call past step_timeout_s is killed once its other episodes end, and replaced). Calls and their
    results are pickled across."""
    workers: Annotated[int, Meta(ge=1)] | None = None
    """Threads that run sync environments' calls (`async def` ones need none); null: one per
    episode in flight (a rollout instance's mini-batch episodes x minibatches_in_flight), so that
    no call waits for a thread while another sleeps in its tool. Threads start as calls need them."""

    def __post_init__(self) -> None:
        check_fields(self)
        if "" in self.stop_strings:
            raise ConfigError(f"stop_strings[{self.stop_strings.index('')}]='': a stop string must not be empty")
        factory = import_dotted(self.factory, "env.factory")
        if not callable(factory):
            raise ConfigError(f"env.factory={self.factory!r}: not callable (expected a class or function)")
        try:
            parameters = inspect.signature(factory).parameters
        except (TypeError, ValueError):  # a callable without a signature to read: only make() can tell
            parameters = {"tools": None} if self.tools else {}
        if self.tools and "tools" not in parameters:
            raise ConfigError(f"env.tools: env.factory={self.factory!r} takes no `tools` keyword to get them "
                              "(stream_rlhf.envs.tool_calls:ToolCalls does)")
        if self.tools and "tools" in self.options:
            raise ConfigError("env.options.tools: give the tools as env.tools (they are passed as the keyword)")
        wants = parameters.get("tools")
        if not self.tools and "tools" not in self.options and wants is not None and wants.default is wants.empty:
            raise ConfigError(f"env.tools: empty, and env.factory={self.factory!r} needs tools")
        self.tool_schemas()

    def tool_functions(self) -> list[Callable[..., Any]]:
        """The functions `tools` names (ConfigError naming the entry that is not one)."""
        functions = []
        for i, path in enumerate(self.tools):
            function = import_dotted(path, f"env.tools[{i}]")
            if not inspect.isfunction(function):
                raise ConfigError(f"env.tools[{i}]={path!r}: not a function")
            functions.append(function)
        return functions

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """The tools' JSON schemas for the chat template (None without tools); ConfigError naming a
        function whose type hints or docstring do not describe it."""
        if not self.tools:
            return None
        schemas = []
        for i, (path, function) in enumerate(zip(self.tools, self.tool_functions())):
            try:
                schemas.append(get_json_schema(function))
            except Exception as error:  # transformers' docstring and type-hint parse errors
                raise ConfigError(f"env.tools[{i}]={path!r}: its type hints and docstring must describe every "
                                  f"argument ({type(error).__name__}: {error})") from None
        return schemas

    def threads(self, episodes_in_flight: int) -> int:
        """Threads for sync calls where `episodes_in_flight` episodes may call at once (`workers`)."""
        return self.workers or episodes_in_flight

    def make(self) -> Environment:
        """A fresh environment for one episode (with `tools`, when there are some)."""
        tools = {"tools": self.tool_functions()} if self.tools else {}
        return import_dotted(self.factory, "env.factory")(**self.options, **tools)
