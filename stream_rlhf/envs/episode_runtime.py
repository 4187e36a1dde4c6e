"""What runs an env job's episodes besides the policy's sampler, for rollout (`stages/episodes.py`)
and evaluation (`driver/evaluate_episodes.py`) alike: the episode loop, the stepper thread the
environments' calls run on and, with `env.processes`, the environments' worker processes.

    runtime = EpisodeRuntime(cfg.env, threads, tokenizer, cfg.data.chat_template, params.max_new_tokens)
    runtime.loop.open(sampler, runtime.stepper, observe, slots)   # or runtime.loop.run(...)
    failures = runtime.close()    # the environments still open are closed; the closes that failed
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from stream_rlhf.data.message_frames import MessageFrames
from stream_rlhf.envs.config import EnvConfig
from stream_rlhf.envs.episode_loop import EpisodeLoop
from stream_rlhf.envs.process_envs import ProcessEnvs
from stream_rlhf.envs.stepper import EnvStepper


class EpisodeRuntime:
    def __init__(self, cfg: EnvConfig, threads: int, tokenizer: PreTrainedTokenizerBase, chat_template: str,
                 max_new_tokens: int):
        """`threads`: sync environment calls that may run at once (`EnvConfig.threads`)."""
        self.tokenizer = tokenizer
        self.processes = ProcessEnvs(cfg, threads) if cfg.processes else None
        frames = MessageFrames.of(tokenizer, chat_template)
        self.loop = EpisodeLoop(cfg, self.decode, self.encode, max_new_tokens, frames,
                                self.processes.make if self.processes else None)
        self.stepper = EnvStepper(cfg.step_timeout_s, threads)

    def decode(self, ids: list[int]) -> str:
        """A turn's text as its environment reads it: no special tokens."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def encode(self, text: str) -> list[int]:
        """An observation's ids."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    @property
    def processes_replaced(self) -> int:
        """Environment processes started so far to replace others (0 without `env.processes`)."""
        return self.processes.replaced if self.processes is not None else 0

    def close(self) -> list[str]:
        """Stop: the environments of episodes still in flight are closed and the worker processes
        end; returns the closes that failed since the last `stepper.close_failures()`."""
        self.stepper.close()
        if self.processes is not None:
            self.processes.close()
        return self.stepper.close_failures()
