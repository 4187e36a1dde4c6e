"""The vLLM engine's TurnSampler (`envs/turns.py`): one vLLM request per policy turn, many in
flight, so that while one episode waits for its tool vLLM keeps generating for the others.

    sampler = engine.turn_sampler(batch, params, slots, capacity)   # VllmRolloutEngine: newest weights first
    sampler.start(TurnRequest(key=3, context=ids, images=None, max_new_tokens=32))
    for done in sampler.advance():                      # waits at most ~ADVANCE_S for turns to end
        ...
    sampler.close()                                     # aborts the turns left

`start` only queues; `advance` sends the queued turns in one SubmitTurns message and polls. The
engine process steps its turns whenever no message waits (`vllm_server.py`), so they progress
while the episode loop runs tools. A turn's context is its whole episode so far; with prefix
caching on, vLLM finds the KV blocks of the episode's earlier turns cached and prefills only the
rest (whole KV blocks only: `rollout.vllm.block_size`, 128 tokens on CPU by default, where 32 is
the smallest; `cached_tokens` counts the hits). A vision-language model's turns carry their
episode's prompt image features each time, as `generate` does, placeholders cut the same way.

Seeds: turn t of an episode samples with a seed drawn from (TurnRequest.episode, t), in a rollout
stage (job seed, "rollout", iteration, mini-batch, index in the mini-batch, t); a request that
names no episode stands for (job seed, "rollout", iteration, mini-batch of the sampler, key)
(`seeding.TurnSeeds`, as the torch sampler seeds its turns). An episode samples the same tokens
whatever the order and company of its turns, and whichever slot it holds when several
mini-batches' episodes share the sampler (`join`).

Weight updates: the engine loads the newest version before the first mini-batch's first turn
(`VllmRolloutEngine.turn_sampler`) and as each later one joins (`join`). With `weights.update:
in_flight`, `pending_update` is also asked at every `advance`. An update offered either way is
held: new turns wait until the running ones end, then the update is loaded and they go. So an
update lands at a turn boundary, each turn is sampled by one version (its
TurnDone.policy_version), and the prefix cache can be reset with nothing running.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from itertools import count

from stream_rlhf.backends.torch_rollout import SamplingParams
from stream_rlhf.backends.vllm_client import GenerateAbandoned, VllmClient
from stream_rlhf.backends.vllm_protocol import Update
from stream_rlhf.envs.turns import TurnDone, TurnRequest
from stream_rlhf.seeding import TurnSeeds
from stream_rlhf.stage import StepAborted

ADVANCE_S = 0.02
"""How long `advance` waits for a turn to end (the engine answers at the end of a step)."""
_SAMPLERS = count()
"""Numbers the samplers of this process, so that request ids never repeat on an engine."""


class VllmTurnSampler:
    """A mini-batch's policy turns as vLLM requests; see the module docstring."""

    def __init__(self, engine: VllmClient, params: SamplingParams, seed_parts: tuple[int | str, ...],
                 max_model_len: int, pending_update: Callable[[], Update | None] | None = None,
                 stopping: threading.Event | None = None, on_close: Callable[[], None] | None = None):
        """`seed_parts` (job seed, "rollout", iteration, mini-batch) seed every turn with its key
        and turn index; `pending_update` (in-flight updates) says which update to load at the next
        turn boundary; `on_close` runs once at `close` (the engine's sleep after a mini-batch)."""
        self.engine = engine
        self.params = params
        self.seeds = TurnSeeds(seed_parts)
        self.max_model_len = max_model_len
        self.pending_update = pending_update
        self.stopping = stopping
        self.on_close = on_close
        self.serial = next(_SAMPLERS)
        self.queued: list[tuple[str, int, TurnRequest]] = []
        """Turns started and not yet sent: request id, seed, request."""
        self.running: dict[str, int] = {}
        """Turns sent to the engine and not ended: request id -> episode key."""
        self.request_numbers = count()
        self.held_update: Update | None = None
        """An update waiting for the running turns to end; no turn is sent meanwhile."""
        self.closed = False
        self.abandoned = False
        self.context_tokens = 0
        """Context tokens of the turns sent (what the engine would prefill without a prefix cache)."""
        self.cached_tokens = 0
        """Context tokens of the turns ended that the prefix cache held."""

    def start(self, request: TurnRequest) -> None:
        if request.key in self.running.values() or any(r.key == request.key for _, _, r in self.queued):
            raise ValueError(f"episode {request.key}: a turn is already running")
        if len(request.context) + request.max_new_tokens > self.max_model_len:
            raise ValueError(f"episode {request.key}: {len(request.context)} context + {request.max_new_tokens} new "
                             f"tokens exceed rollout.vllm.max_model_len={self.max_model_len} (keep "
                             "env.max_episode_tokens within it)")
        seed = self.seeds.next(request.key, request.episode)
        self.queued.append((f"s{self.serial}.{request.key}.{next(self.request_numbers)}", seed, request))

    def advance(self) -> list[TurnDone]:
        self._update_at_turn_boundary()
        if self.queued and self.held_update is None:
            self._submit()
        if not self.running:
            return []
        try:
            request_ids, gen, cached = self.engine.poll_turns(ADVANCE_S, self.stopping)
        except GenerateAbandoned as exc:
            self.abandoned = True  # the engine still owes that poll's answer: close sends it nothing
            raise StepAborted(str(exc)) from None
        self.cached_tokens += sum(cached)
        done = []
        for i, request_id in enumerate(request_ids):
            key = self.running.pop(request_id)
            versions = gen.token_versions[i]  # one version by construction (updates wait for turn ends)
            done.append(TurnDone(key, gen.response_ids[i], gen.response_logp[i], gen.finish_reasons[i],
                                 int(versions.min()) if len(versions) else self.engine.version))
        return done

    def join(self, update: Update | None) -> None:
        """Another mini-batch's episodes join: `update` (the newest weights, if newer than the
        engine's) is loaded at the next turn boundary, before any of their turns is sent."""
        if update is not None:
            self.held_update = update

    @property
    def busy(self) -> bool:
        return bool(self.queued or self.running)

    def release(self, key: int) -> None:
        """Drop a turn of episode `key` still queued or running (none once the loop saw it end);
        its slot may take another episode."""
        self.queued = [q for q in self.queued if q[2].key != key]
        self.seeds.release(key)
        dropped = [request_id for request_id, k in self.running.items() if k == key]
        if dropped:
            self.engine.abort_turns(dropped)
            for request_id in dropped:
                del self.running[request_id]

    def close(self) -> None:
        """Abort every turn left, then `on_close`; idempotent. With the engine abandoned (it is
        killed, not put to sleep) or dead (it failed the last call) nothing is sent to it."""
        if self.closed:
            return
        self.closed = True
        self.queued.clear()
        reachable = not self.abandoned and self.engine.alive
        if self.running and reachable:
            self.engine.abort_turns(list(self.running))
        self.running.clear()
        if self.on_close is not None and reachable:
            self.on_close()

    def _submit(self) -> None:
        queued, self.queued = self.queued, []
        requests = [r for _, _, r in queued]
        images = None if all(r.images is None for r in requests) else [r.images for r in requests]
        self.engine.submit_turns([i for i, _, _ in queued], [r.context for r in requests], self.params,
                                 [s for _, s, _ in queued], [r.max_new_tokens for r in requests], images)
        self.running.update((request_id, r.key) for request_id, _, r in queued)
        self.context_tokens += sum(len(r.context) for r in requests)

    def _update_at_turn_boundary(self) -> None:
        """Hold the update offered (by `join`, or in flight), and load it once no turn runs."""
        if self.held_update is None and self.pending_update is not None:
            self.held_update = self.pending_update()
        if self.held_update is not None and not self.running:
            update, self.held_update = self.held_update, None
            self.engine.update(update.version, update.method, *update.args)
