"""A vLLM engine as a rollout backend: continuous batching, behaviour log-probs, in-place weight updates.

    engine = VllmRollout(checkpoint, VllmOptions(max_model_len=64, cpu_cores=[0]))
    gen = engine.generate(prompts, params, seeds)       # a `VllmGeneration`, like torch_rollout's
    gen = engine.generate(prompts, params, seeds, images=images)   # a VLM: one `SampleImages` per prompt
    engine.call("srl_join", "shm", link.to_json(), "rollout-0", 2)   # the trainer's weight transport
    engine.update(3, "srl_receive", 3)                  # the newest version >= 3 through it
    engine.submit_turns(["s0.2.1"], [context], params, [seed], [32])   # multi-turn: returns at once
    engine.step_turns(); ids, gen, cached = engine.take_turns()        # the turns that ended
    engine.close()

This runs in the engine process (`vllm_server.py`, started by `vllm_client.py`), which may use
another Python environment than the rest of the job.

The rest of the pipeline cannot tell this backend from `torch_rollout`: responses are token ids
(the stop token included), and the behaviour log-prob of each sampled token is taken under the
full tempered distribution softmax(logits / temperature) (vLLM's `processed_logprobs` at top_p 1;
untempered when greedy), which a later forward recomputes with `sequence_logprobs`.

Vision-language checkpoints (Qwen2-VL): the vision stage already encoded the images, so vLLM gets
each prompt's image features as image embeddings (`enable_mm_embeds`) and never runs its vision
tower. Our prompts hold every image expanded (`<|vision_start|>`, one `<|image_pad|>` per image
token, `<|vision_end|>`); vLLM wants one `<|image_pad|>` per image and expands it from the image's
grid itself (an expanded run would be expanded again), so each run is cut to one placeholder on the
way in. vLLM then computes the same M-RoPE positions as `mrope_positions`. As in the torch
backend, responses never sample the image token; here the ban is part of vLLM's processing, so the
behaviour log-prob is renormalised without it: it exceeds the full-distribution value by
-log(1 - p(image token)), nothing for a model that never wants an image token in a response.

Weight versions: the engine labels every output token with the version in force when it was
sampled (vLLM's weight-version spans). `update` pauses the scheduler (running requests keep their
KV cache), loads the new weights through the worker extension (`vllm_worker.py`), relabels and
resumes, so called between mini-batches it is a drain update and called from the `between_steps`
hook of `generate` it is an in-flight one; `VllmGeneration.token_versions` then says which
version sampled each token.

vLLM starts its engine core in a process of its own (spawn), and that process its worker, so the
main module must be guarded by `if __name__ == "__main__"` (vllm_server's is). On CPU both run in
this process instead (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, which also keeps vLLM's single-worker
executor): each of those processes imported vLLM anew, ~9 s apiece, so an engine took ~32 s to
start here and now takes ~14 s; this process steps the engine and talks to nothing else meanwhile,
so the core's own process gained nothing. Call `close()` at the end, or vLLM kills the
engine process at interpreter exit. On CPU the engine's threads are pinned to `cpu_cores`, one
torch thread per core, and `VLLM_CPU_KVCACHE_SPACE` sizes its KV cache; sleep mode exists only
on CUDA (`sleep()` says so and does nothing on CPU).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from itertools import count
from typing import Any

import torch
from torch import Tensor

from stream_rlhf.backends.torch_rollout import Generation, SamplingParams
from stream_rlhf.models.checkpoint import is_vision_language
from stream_rlhf.samples import SampleImages

log = logging.getLogger(__name__)
WORKER_EXTENSION = "stream_rlhf.backends.vllm_worker.WeightSyncExtension"
SHUTDOWN_GRACE_S = 30.0


@dataclass(frozen=True)
class VllmOptions:
    max_model_len: int
    """Prompt + response tokens per sequence."""
    kv_cache_gb: float = 1.0
    """CPU: the KV cache size (VLLM_CPU_KVCACHE_SPACE, whole GiB, at least 1)."""
    gpu_memory_utilization: float = 0.5
    """CUDA: the fraction of the device vLLM may take (the rest is for colocated training)."""
    tensor_parallel_size: int = 1
    enforce_eager: bool = True
    """No CUDA graphs / torch.compile: starts in seconds instead of tens of seconds."""
    prefix_caching: bool = True
    """Off for in-flight updates: KV blocks cached under old weights would serve new requests."""
    max_num_seqs: int = 256
    """Sequences decoded together (continuous batching)."""
    cpu_cores: list[int] | None = None
    """CPU: cores the engine's threads are bound to, one torch thread each (None: not bound)."""
    seed: int = 0
    max_images_per_prompt: int = 4
    """Vision-language checkpoints: images a prompt may hold (vLLM's limit_mm_per_prompt)."""
    block_size: int | None = None
    """KV cache block size in tokens; None: vLLM's (16 on CUDA, 128 on CPU). The prefix cache
    reuses whole blocks only."""


@dataclass
class VllmGeneration(Generation):
    token_versions: list[Tensor] | None = None
    """(R_i,) int32 weight version that sampled each response token."""


class VllmRollout:
    def __init__(self, checkpoint: str, options: VllmOptions):
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(options.kv_cache_gb)))
        from vllm import EngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.llm_engine import LLMEngine

        if current_platform.is_cpu():  # the engine core and its worker in this process (module docstring)
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            if options.cpu_cores is not None:  # vLLM binds only a worker process of its own: bound here
                os.sched_setaffinity(0, options.cpu_cores)  # this thread, and every thread started after it
                os.environ["OMP_NUM_THREADS"] = str(len(options.cpu_cores))  # vLLM's thread count reads it
                torch.set_num_threads(len(options.cpu_cores))

        vision_language = is_vision_language(checkpoint)
        # images come as the vision stage's features (image embeddings), never as pixels or video
        # (no processor cache: the workers' reload clears their side of it, and the features are cheap to resend)
        images = {"enable_mm_embeds": True, "limit_mm_per_prompt": {"image": options.max_images_per_prompt, "video": 0},
                  "mm_processor_cache_gb": 0}
        args = EngineArgs(
            model=checkpoint,
            dtype="float32",
            max_model_len=options.max_model_len,
            enforce_eager=options.enforce_eager,
            tensor_parallel_size=options.tensor_parallel_size,
            gpu_memory_utilization=options.gpu_memory_utilization,
            enable_prefix_caching=options.prefix_caching,
            block_size=options.block_size,
            max_num_seqs=options.max_num_seqs,
            # a prompt chunked across steps makes vLLM's CPU sampler rewind the request's seeded
            # generator, which CPU generators cannot do (the engine core dies): on CPU a prompt that
            # does not fit a step's token budget waits for the next step instead
            enable_chunked_prefill=False if current_platform.is_cpu() else None,
            seed=options.seed,
            worker_extension_cls=WORKER_EXTENSION,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",  # our SamplingParams only, not the checkpoint's defaults
            **(images if vision_language else {}),
        )
        self.engine = LLMEngine.from_engine_args(args)
        self.image_token_id: int | None = self.engine.model_config.hf_config.image_token_id if vision_language else None
        # vLLM's strongest bias (it clamps to +-100): a response never holds an image token
        self.no_image_tokens = None if self.image_token_id is None else {self.image_token_id: -100.0}
        self.prefix_caching = options.prefix_caching
        self.version = 0
        self.closed = False
        self.said_no_sleep = False
        self.engine.set_weight_version("0")
        self._request_ids = count()
        self.turns_running: set[str] = set()
        """Multi-turn episodes: the request ids of turns submitted and not ended."""
        self.turns_ended: dict[str, Any] = {}
        """Turns ended and not yet taken, by request id (vLLM's RequestOutput)."""

    def generate(
        self,
        prompts: list[Tensor],
        params: SamplingParams,
        seeds: list[int],
        between_steps: Callable[[], None] | None = None,
        images: list[SampleImages] | None = None,
    ) -> VllmGeneration:
        """Sample one response per prompt (P_i,) with per-prompt `seeds`; `between_steps` is
        called after every engine step (an in-flight weight update goes there). A vision-language
        checkpoint takes `images`, one per prompt (None: no prompt has images)."""
        if len(seeds) != len(prompts):
            raise ValueError(f"seeds: {len(seeds)} for {len(prompts)} prompts: must be one per prompt")
        if images is not None and len(images) != len(prompts):
            raise ValueError(f"images: {len(images)} for {len(prompts)} prompts: must be one per prompt")
        if images is not None and self.image_token_id is None:
            raise ValueError("images given to the engine of a text-only checkpoint")
        if self.turns_running:
            raise ValueError(f"generate while {len(self.turns_running)} multi-turn requests run: abort them first")
        if not prompts:
            return _generation([])
        # vLLM's own rendering of each prompt (token ids, image placeholders and embeddings)
        inputs = self.engine.renderer.render_cmpl(
            [self._prompt(prompt, None if images is None else images[i]) for i, prompt in enumerate(prompts)])
        ids = []
        for engine_input, seed in zip(inputs, seeds):
            request_id = f"r{next(self._request_ids)}"
            self.engine.add_request(request_id, engine_input, self._sampling(params, seed, params.max_new_tokens))
            ids.append(request_id)
        finished: dict[str, Any] = {}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output.outputs[0]
            if between_steps is not None:
                between_steps()
        return _generation([finished[i] for i in ids])

    def submit_turns(self, request_ids: list[str], contexts: list[Tensor], params: SamplingParams, seeds: list[int],
                     max_new_tokens: list[int], images: list[SampleImages] | None = None) -> None:
        """Add one request per policy turn (context (L,) each: its episode so far) and return at
        once; `step_turns` advances them. With prefix caching on, a turn's context finds the
        blocks of its episode's earlier turns cached."""
        if images is not None and self.image_token_id is None:
            raise ValueError("images given to the engine of a text-only checkpoint")
        inputs = self.engine.renderer.render_cmpl(
            [self._prompt(context, None if images is None else images[i]) for i, context in enumerate(contexts)])
        for request_id, engine_input, seed, budget in zip(request_ids, inputs, seeds, max_new_tokens, strict=True):
            self.engine.add_request(request_id, engine_input, self._sampling(params, seed, budget))
            self.turns_running.add(request_id)

    def step_turns(self) -> None:
        """One engine step; the turns that end are kept for `take_turns`."""
        for output in self.engine.step():
            if output.finished and output.request_id in self.turns_running:
                self.turns_running.discard(output.request_id)
                self.turns_ended[output.request_id] = output

    def take_turns(self) -> tuple[list[str], VllmGeneration, list[int]]:
        """The turns that ended since the last call: their request ids, responses, and the
        context tokens of each that the prefix cache held."""
        ended, self.turns_ended = self.turns_ended, {}
        outputs = list(ended.values())
        return list(ended), _generation([o.outputs[0] for o in outputs]), [o.num_cached_tokens or 0 for o in outputs]

    def abort_turns(self, request_ids: list[str]) -> None:
        """Drop these turns, running or ended and not yet taken."""
        running = [i for i in request_ids if i in self.turns_running]
        self.engine.abort_request(running)
        self.turns_running.difference_update(running)
        for request_id in request_ids:
            self.turns_ended.pop(request_id, None)

    def _sampling(self, params: SamplingParams, seed: int, max_new_tokens: int) -> Any:
        """vLLM's sampling params for one request."""
        from vllm import SamplingParams as VllmSamplingParams

        return VllmSamplingParams(
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=max_new_tokens,
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=True,  # stop at `stop_token_ids` only, exactly as the torch backend
            logprobs=0,  # the sampled token's
            seed=seed,
            # stop strings (a turn's) need the text; the tokens up to the one completing the string stay
            stop=list(params.stop_strings) or None,
            include_stop_str_in_output=True,
            detokenize=bool(params.stop_strings),
            logit_bias=self.no_image_tokens,
        )

    def _prompt(self, prompt: Tensor, images: SampleImages | None) -> dict[str, Any]:
        """vLLM's prompt: the token ids, and for a prompt with images one placeholder per image
        with the image features vLLM puts at that image's tokens."""
        if images is None or len(images.grid_thw) == 0:
            return {"prompt_token_ids": prompt.tolist()}
        return {
            "prompt_token_ids": one_placeholder_per_image(prompt, self.image_token_id).tolist(),
            "multi_modal_data": {"image": {"image_embeds": images.features, "image_grid_thw": images.grid_thw}},
        }

    def call(self, method: str, *args: Any) -> list[Any]:
        """Call `method(*args)` of the workers' `WeightSyncExtension`; one result per worker."""
        if not method.startswith("srl_"):
            raise ValueError(f"method={method!r}: not a WeightSyncExtension method (srl_...)")
        return self.engine.collective_rpc(method, args=args)

    def update(self, version: int, method: str, *args: Any) -> None:
        """Load weights by calling `method(*args)` of the workers and label the tokens sampled from
        now on with the version loaded (the method's result when it returns one, else `version`).
        Requests in flight keep their KV cache; the scheduler is paused meanwhile, so no step runs
        with a half-loaded model."""
        self._scheduler("pause_scheduler", "keep", False)
        try:
            loaded = self.call(method, *args)[0]
            version = loaded if isinstance(loaded, int) else version
            self.engine.set_weight_version(str(version))
            if self.image_token_id is not None:
                self.engine.reset_encoder_cache()  # the reload dropped encoder outputs the scheduler counts on
        finally:
            self._scheduler("resume_scheduler")
        if self.prefix_caching and not self.engine.reset_prefix_cache():
            raise RuntimeError("prefix cache not reset after a weight update (requests still running): "
                               "turn prefix caching off for in-flight updates")
        self.version = version

    def _scheduler(self, method: str, *args: Any) -> None:
        """Call the engine core's scheduler `method`: through vLLM's utility call to the engine core's
        process, or directly where the core runs in this process (CPU; this thread steps it)."""
        core = self.engine.engine_core
        if hasattr(core, "call_utility"):
            core.call_utility(method, *args)
        else:
            getattr(core.engine_core, method)(*args)

    def sleep(self) -> None:
        """Release the KV cache and offload the weights (CUDA); on CPU a no-op that says so."""
        if not torch.cuda.is_available():
            if not self.said_no_sleep:
                log.info("vLLM sleep mode exists only on CUDA: on CPU rollout keeps its memory (said once)")
                self.said_no_sleep = True
            return
        self.engine.sleep(level=1)

    def wake_up(self, update: tuple[Any, ...] | None = None) -> None:
        """Wake the weights, apply `update` (version, method, *args) if given, then wake the KV
        cache: waking both at once holds the old KV cache beside the new weights (out of memory
        on large models)."""
        on_cuda = torch.cuda.is_available()
        if on_cuda:
            self.engine.wake_up(tags=["weights"])
        if update is not None:
            self.update(*update)
        if on_cuda:
            self.engine.wake_up(tags=["kv_cache"])

    def close(self) -> None:
        """Stop the engine core process (it would be force-killed at exit otherwise); idempotent."""
        if not self.closed:
            self.closed = True
            # vLLM's default grace is 5 s, then it kills the engine core mid-teardown
            self.engine.engine_core.shutdown(timeout=SHUTDOWN_GRACE_S)


def one_placeholder_per_image(ids: Tensor, image_token_id: int) -> Tensor:
    """ids (L,) with each run of image tokens cut to its first token."""
    is_image = ids == image_token_id
    keep = torch.ones_like(is_image)
    keep[1:] = ~(is_image[1:] & is_image[:-1])
    return ids[keep]


def _generation(completions: list[Any]) -> VllmGeneration:
    response_ids, response_logp, reasons, versions = [], [], [], []
    for completion in completions:
        tokens = list(completion.token_ids)
        response_ids.append(torch.tensor(tokens, dtype=torch.long))
        response_logp.append(torch.tensor(
            [step[token].logprob for step, token in zip(completion.logprobs, tokens, strict=True)], dtype=torch.float32
        ))
        reasons.append("stop" if completion.finish_reason == "stop" else "length")
        token_versions = torch.zeros(len(tokens), dtype=torch.int32)
        for span in completion.weight_versions or []:
            token_versions[span.start : span.end] = int(span.version)
        versions.append(token_versions)
    return VllmGeneration(response_ids, response_logp, reasons, token_versions=versions)
