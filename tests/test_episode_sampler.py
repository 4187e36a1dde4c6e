"""The torch TurnSampler (`backends/episode_sampler.py`): multi-turn episodes joining and leaving
one slot cache, driven by a scripted environment; their behaviour log-probs against full forwards."""

from __future__ import annotations

import copy
import logging
import threading
from collections import Counter
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from stream_rlhf.backends.decode_attention import use_decode_attention
from stream_rlhf.backends.episode_sampler import TorchTurnSampler, step_width
from stream_rlhf.backends.keyed_draws import inverse_cdf, keyed_uniforms
from stream_rlhf.backends.static_decode import StaticDecoder
from stream_rlhf.backends.torch_rollout import SamplingParams, generate, sampling_probs
from stream_rlhf.backends.torch_rollout_engine import TorchRolloutEngine
from stream_rlhf.backends.turn_stop import TurnStop
from stream_rlhf.broker.control.messages import Handle
from stream_rlhf.config import build
from stream_rlhf.envs.turns import TurnDone, TurnRequest
from stream_rlhf.models.checkpoint import build_tiny, save_checkpoint
from stream_rlhf.models.model_config import TinyModelConfig
from stream_rlhf.models.packing import sequence_logprobs
from stream_rlhf.models.tokenizer import build_tokenizer
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.samples import SampleImages, ragged
from stream_rlhf.seeding import TurnSeeds
from stream_rlhf.stage import Batch, StageContext
from stream_rlhf.stages.images import ImageInputs
from stream_rlhf.stages.job_context import JobContext
from stream_rlhf.stages.weight_sync import RolloutWeights
from stream_rlhf.telemetry.stage_counts import StageCounts
from tests.rl_tiny import tiny_job
from tests.test_vision_language import IMAGE, TEXT_IDS, build_model, encode, make_sample
from tests.tiny_models import tiny_qwen2_config

VOCAB = 48
ATOL = 1e-5
STOPS = (3, 7, 11, 20, 26)


@pytest.fixture(scope="module")
def lm() -> PreTrainedModel:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_qwen2_config(VOCAB)).eval()


@pytest.fixture
def prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in (6, 1, 3, 9)]


def sampler(model, slots: int, params: SamplingParams, seed: int = 0, capacity: int = 64,
            static: StaticDecoder | None = None) -> TorchTurnSampler:
    return TorchTurnSampler(model, slots, capacity, params, (seed,), policy_version=5,
                            static=static)


def run_episodes(turns: TorchTurnSampler, prompts: list[torch.Tensor], images: list[SampleImages | None],
                 observations: list[torch.Tensor], waits: list[int], n_turns: int, max_new: int,
                 late: dict[int, int] | None = None, names: list[tuple[int | str, ...]] | None = None,
                 ) -> tuple[list[torch.Tensor], list[dict[int, float]], list[TurnDone]]:
    """A scripted environment: episode k starts after late[k] advances (0 by default); after each
    of its turns it waits waits[k] advances, appends observations[k] and starts the next turn,
    n_turns turns in all; its requests name it names[k] (TurnRequest.episode; default none).
    Returns the final sequences, each episode's behaviour log-prob by sequence index, and every
    TurnDone."""
    contexts = [p.clone() for p in prompts]
    logps: list[dict[int, float]] = [{} for _ in prompts]
    count, done = [0] * len(prompts), []
    starting = {key: (late or {}).get(key, 0) for key in range(len(prompts))}
    waiting: dict[int, int] = {}
    while turns.busy or waiting or starting:
        for key in sorted(starting):
            if starting[key] > 0:
                starting[key] -= 1
                continue
            del starting[key]
            turns.start(TurnRequest(key, contexts[key], images[key], max_new, names[key] if names else ()))
        for turn in turns.advance():
            done.append(turn)
            key, start = turn.key, contexts[turn.key].numel()
            logps[key].update({start + i: lp for i, lp in enumerate(turn.logps.tolist())})
            contexts[key] = torch.cat([contexts[key], turn.ids])
            count[key] += 1
            if count[key] < n_turns:
                waiting[key] = waits[key]
        for key in sorted(waiting):
            if waiting[key] > 0:
                waiting[key] -= 1
                continue
            del waiting[key]
            contexts[key] = torch.cat([contexts[key], observations[key]])
            turns.start(TurnRequest(key, contexts[key], images[key], max_new, names[key] if names else ()))
    return contexts, logps, done


def assert_logps_equal_forward(model, contexts, logps, temperature, images=None) -> None:
    with torch.no_grad():
        recomputed, _ = sequence_logprobs(model, contexts, temperature=temperature, images=images)
    for behaviour, again in zip(logps, recomputed):
        at = torch.tensor(sorted(behaviour))
        torch.testing.assert_close(torch.tensor([behaviour[i] for i in sorted(behaviour)]), again[at - 1],
                                   atol=ATOL, rtol=0)


def test_one_greedy_turn_started_together_is_generate(lm, prompts):
    params = SamplingParams(temperature=0.0, top_p=0.9, max_new_tokens=10, stop_token_ids=STOPS)
    gen = generate(lm, prompts, params, torch.Generator().manual_seed(0))
    turns = sampler(lm, len(prompts), params)
    for key, prompt in enumerate(prompts):
        turns.start(TurnRequest(key, prompt, None, params.max_new_tokens))
    done = {}
    while turns.busy:
        done.update({turn.key: turn for turn in turns.advance()})
    assert turns.advance() == []
    assert sorted(gen.finish_reasons) != ["length"] * len(prompts)  # some rows stopped early
    for key in range(len(prompts)):
        assert torch.equal(done[key].ids, gen.response_ids[key])
        torch.testing.assert_close(done[key].logps, gen.response_logp[key], atol=ATOL, rtol=0)
        assert (done[key].finish_reason, done[key].policy_version) == (gen.finish_reasons[key], 5)


@pytest.mark.parametrize("mode", ["eager", "static", "decode_attention"])
def test_staggered_turns_record_the_full_forward_logps(lm, prompts, mode):
    params = SamplingParams(temperature=0.7, max_new_tokens=6, stop_token_ids=STOPS)
    g = torch.Generator().manual_seed(2)
    observations = [torch.randint(1, VOCAB, (n,), generator=g) for n in (4, 1, 7, 2)]
    model = lm
    if mode == "decode_attention":  # the rollout engine's attention (`backends/decode_attention.py`)
        model = copy.deepcopy(lm)
        use_decode_attention(model)
    turns = sampler(model, len(prompts), params, static=StaticDecoder(graphs=False) if mode == "static" else None)
    contexts, logps, done = run_episodes(turns, prompts, [None] * 4, observations, waits=[0, 5, 2, 9], n_turns=3,
                                         max_new=6)
    assert len(done) == 12 and {t.finish_reason for t in done} == {"stop", "length"}
    assert [t.key for t in done] != sorted(t.key for t in done)  # turns of different episodes interleave
    assert_logps_equal_forward(lm, contexts, logps, 0.7)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_other_episodes_do_not_change_an_episode(lm, prompts, temperature):
    """Each episode samples the same turns staggered among others, alone in a sampler of one slot,
    and in another slot beside episodes that start and wait differently: its turns draw from streams
    seeded by its name and their index (`seeding.TurnSeeds`, `keyed_draws.py`), not from a
    generator shared with the rows beside it."""
    params = SamplingParams(temperature=temperature, top_p=0.9, max_new_tokens=5, stop_token_ids=STOPS)
    observations = [torch.tensor([5, 6, 9])] * 4
    names = [("job", "rollout", 3, 1, k) for k in range(4)]
    together, logps, done = run_episodes(sampler(lm, 4, params), prompts, [None] * 4, observations, [3, 0, 6, 1], 3, 5,
                                         names=names)
    assert [t.key for t in done] != sorted(t.key for t in done)  # turns of different episodes interleave
    order = [2, 0, 3, 1]  # episode k in slot order.index(k), started late and waiting otherwise
    shuffled, _, _ = run_episodes(sampler(lm, 4, params, seed=9), [prompts[k] for k in order], [None] * 4,
                                  [observations[k] for k in order], [0, 4, 2, 7], 3, 5, late={0: 3, 2: 1},
                                  names=[names[k] for k in order])
    for key, prompt in enumerate(prompts):
        alone, alone_logps, _ = run_episodes(sampler(lm, 1, params), [prompt], [None], [observations[key]], [0], 3, 5,
                                             names=[names[key]])
        assert torch.equal(together[key], alone[0])
        assert torch.equal(together[key], shuffled[order.index(key)])
        assert alone_logps[0].keys() == logps[key].keys()
        torch.testing.assert_close(torch.tensor(list(alone_logps[0].values())), torch.tensor(list(logps[key].values())),
                                   atol=ATOL, rtol=0)
    if temperature > 0:  # the name is what seeds: other names sample other turns
        renamed, _, _ = run_episodes(sampler(lm, 4, params), prompts, [None] * 4, observations, [3, 0, 6, 1], 3, 5,
                                     names=[("job", "rollout", 4, 1, k) for k in range(4)])
        assert [r.tolist() for r in renamed] != [t.tolist() for t in together]


def test_a_turns_tokens_read_its_stream_in_order(lm, prompts):
    """Token k of turn t of the episode named N is inverse_cdf(top-p probs, keyed_uniforms(seed, k)),
    seed = turn t's of N (`TurnSeeds`): checked against a full forward's logits at every position."""
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=8, stop_token_ids=())
    name = ("job", "rollout", 0, 2, 5)
    contexts, _, done = run_episodes(sampler(lm, 1, params), prompts[:1], [None], [torch.tensor([5, 6])], [1], 2, 8,
                                     names=[name])
    seeds = TurnSeeds(())
    turn_seeds = [seeds.next(0, name), seeds.next(0, name)]
    with torch.no_grad():
        logits = lm(contexts[0][None]).logits[0]  # (L, V)
    start = len(prompts[0])
    for turn, seed in zip(done, turn_seeds):
        probs = sampling_probs(logits[start - 1:start - 1 + len(turn.ids)], params)
        uniforms = torch.from_numpy(keyed_uniforms([seed] * len(turn.ids), range(len(turn.ids))))
        assert torch.equal(turn.ids, inverse_cdf(probs, uniforms))
        start += len(turn.ids) + 2  # the observation
    assert len(done) == 2 and not torch.equal(done[0].ids, done[1].ids)


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen3_vl"])
def test_vision_language_turns_record_the_full_forward_logps(kind):
    vlm = build_model(kind).eval()
    g = torch.Generator().manual_seed(3)
    samples = [make_sample(g, [2, 3], [(1, 4, 4)]), make_sample(g, [5, 1, 2], [(1, 4, 6), (1, 8, 4)]),
               make_sample(g, [4], []), make_sample(g, [1, 2, 2], [(1, 4, 4), (1, 4, 4)])]
    images = [encode(vlm, s) for s in samples]
    observations = [torch.randint(*TEXT_IDS, (n,), generator=g) for n in (3, 1, 5, 2)]
    params = SamplingParams(temperature=0.7, max_new_tokens=5, stop_token_ids=(TEXT_IDS[0] + 1,))
    turns = sampler(vlm, 4, params)
    # episode 3 starts while the others decode: its prompt is fed 3 ids a step, its images split across steps
    contexts, logps, _ = run_episodes(turns, [s.input_ids for s in samples], images, observations,
                                      waits=[2, 0, 4, 1], n_turns=3, max_new=5, late={3: 2})
    for context, sample in zip(contexts, samples):
        assert not (context[sample.input_ids.numel():] == IMAGE).any()
    assert_logps_equal_forward(vlm, contexts, logps, 0.7, images)


@pytest.mark.parametrize("static", [False, True])
def test_a_long_join_beside_decoding_episodes(lm, prompts, static):
    """3 episodes decode, a 12-id context joins. Eager: the join is a forward of its own, its
    whole context in one step, while the decoding episodes' forward stays one position wide. A
    static bucket (one forward over every row): 3 ids per step (the widest step at most half
    padding: 4 rows x 3 positions for 6 real ids), its one token in the 4th step."""
    params = SamplingParams(temperature=0.7, max_new_tokens=20)
    turns = sampler(lm, 4, params, capacity=32, static=StaticDecoder(graphs=False) if static else None)
    for key in range(3):
        turns.start(TurnRequest(key, prompts[key], None, 20))
    turns.advance()
    joining = torch.cat([prompts[3], prompts[3][:3]])  # 12 ids
    turns.start(TurnRequest(3, joining, None, 1))
    steps = 4 if static else 1
    for step in range(1, steps + 1):
        lengths = [len(turns.episodes[key].ids) for key in range(3)]
        done = turns.advance()
        assert [t.key for t in done] == ([3] if step == steps else [])
        assert [len(turns.episodes[key].ids) for key in range(3)] == [n + 1 for n in lengths]  # they decoded on
    assert_logps_equal_forward(lm, [torch.cat([joining, done[0].ids])], [{12: done[0].logps.item()}], 0.7)


def letters(ids: list[int]) -> str:
    """A toy decode: each id one letter."""
    return "".join(chr(ord("a") + i % 26) for i in ids)


def test_a_stop_string_ends_a_turn_at_the_token_that_completes_it(lm, prompts):
    """The two letters written most often inside the turns of a free run, as a stop string: every
    turn that writes them ends at the token completing them (reason "stop"), the log-probs still
    the full forward's."""
    params = SamplingParams(temperature=1.0, max_new_tokens=10)
    g = torch.Generator().manual_seed(3)
    observations = [torch.randint(1, VOCAB, (n,), generator=g) for n in (4, 1, 7, 2)]
    *_, free = run_episodes(sampler(lm, len(prompts), params), prompts, [None] * 4, observations, [0, 1, 2, 0], 3, 10)
    inside = Counter(letters(t.ids[i:i + 2].tolist()) for t in free for i in range(len(t.ids) - 2))
    stop, _ = inside.most_common(1)[0]
    stopping = replace(params, stop_strings=(stop,))
    turns = TorchTurnSampler(lm, len(prompts), 64, stopping, (0,), 5,
                             stop_text=TurnStop((stop,), letters))
    contexts, logps, done = run_episodes(turns, prompts, [None] * 4, observations, [0, 1, 2, 0], 3, 10)
    by_string = [stop in letters(t.ids.tolist()) for t in done]
    assert any(by_string), stop
    for turn, written in zip(done, by_string):
        if written:
            assert letters(turn.ids.tolist()).endswith(stop) and turn.finish_reason == "stop"
        else:
            assert len(turn.ids) == 10 and turn.finish_reason == "length"
    assert_logps_equal_forward(lm, contexts, logps, temperature=1.0)
    with pytest.raises(ValueError, match=r"stop_strings=\('ab',\) need a stop_text"):
        TorchTurnSampler(lm, 2, 64, replace(params, stop_strings=("ab",)), (), 0)


def test_step_width_keeps_padding_at_most_half_the_step():
    assert step_width([1, 1, 1, 1], slots=4, free_positions=0) == 1
    assert step_width([9, 6, 3, 1], slots=4, free_positions=0) == 9  # 19 ids in 36 positions
    assert step_width([100, 10, 10, 10], slots=4, free_positions=0) == 30  # 60 ids in 120 positions
    assert step_width([12], slots=64, free_positions=0) == 1
    assert step_width([12, 1], slots=64, free_positions=1024) == 12


def test_release_frees_the_slot_for_a_new_episode(lm, prompts):
    params = SamplingParams(temperature=0.7, max_new_tokens=4)
    turns = sampler(lm, 2, params, capacity=16)
    assert not turns.busy
    turns.start(TurnRequest(0, prompts[3], None, 4))
    turns.start(TurnRequest(1, prompts[0], None, 4))
    assert turns.busy
    while turns.busy:
        turns.advance()
    turns.release(0)
    # a new episode in slot 0, while episode 1 takes its second turn beside it
    contexts = [prompts[2], torch.cat([prompts[0], torch.tensor([1, 2])])]
    with pytest.raises(ValueError, match="must begin with"):
        turns.start(TurnRequest(1, contexts[1], None, 4))  # it lacks episode 1's first turn
    logps: list[dict[int, float]] = [{}, {}]
    turns.start(TurnRequest(0, contexts[0], None, 4))
    assert turns.busy
    while turns.busy:
        for turn in turns.advance():
            start = contexts[turn.key].numel()
            logps[turn.key] = {start + i: lp for i, lp in enumerate(turn.logps.tolist())}
            contexts[turn.key] = torch.cat([contexts[turn.key], turn.ids])
    assert not turns.busy and turns.advance() == []
    assert_logps_equal_forward(lm, contexts[:1], logps[:1], 0.7)
    turns.close()
    assert turns.episodes == {} and not bool(turns.cache.valid.any())


def test_a_step_covers_only_the_episodes_in_a_turn(lm, prompts):
    """The episodes in a turn hold the cache's first rows; an episode between turns (waiting for its
    tool) leaves the step, and its KV goes where its row goes."""
    params = SamplingParams(temperature=0, max_new_tokens=3)  # greedy: three tokens, no stop
    turns = sampler(lm, 4, params)
    for key in (3, 2):  # episodes 3 and 2 first: they take rows 0 and 1
        turns.start(TurnRequest(key, prompts[key], None, 3))
    assert [turns.row_of[key] for key in (3, 2)] == [0, 1]
    first = {}
    while len(first) < 2:
        first.update({t.key: t for t in turns.advance()})
    turns.start(TurnRequest(0, prompts[0], None, 3))
    turns.advance()
    assert turns.cache.rows == slice(0, 1) and turns.row_of[0] == 0  # episodes 2 and 3 wait: not in the step
    context = torch.cat([prompts[3], first[3].ids, torch.tensor([5, 6])])
    turns.start(TurnRequest(3, context, None, 3))  # back from its tool beside episode 0
    assert sorted(turns.row_of[key] for key in turns.turning) == [0, 1]
    second = {}
    while turns.busy:
        second.update({t.key: t for t in turns.advance()})
    alone = sampler(lm, 1, params)  # the same two turns with no other episode
    solo = []
    for request in (TurnRequest(0, prompts[3], None, 3), TurnRequest(0, context, None, 3)):
        alone.start(request)
        while alone.busy:
            solo += alone.advance()
    assert [t.ids.tolist() for t in solo] == [first[3].ids.tolist(), second[3].ids.tolist()]
    turns.close()
    alone.close()


def test_errors_name_the_limit(lm, prompts):
    params = SamplingParams(max_new_tokens=4)
    turns = sampler(lm, 2, params, capacity=10)
    with pytest.raises(ValueError, match=r"12 positions; the sampler holds 10 per episode"):
        turns.start(TurnRequest(0, prompts[3], None, 4))  # 9 ids + 4 new - 1
    with pytest.raises(ValueError, match="key=2"):
        turns.start(TurnRequest(2, prompts[0], None, 4))
    turns.start(TurnRequest(0, prompts[0], None, 4))
    with pytest.raises(ValueError, match="has not ended"):
        turns.start(TurnRequest(0, prompts[0], None, 4))
    with pytest.raises(ValueError, match="image"):
        turns.start(TurnRequest(1, prompts[1], SampleImages(torch.zeros(0, 4), torch.zeros(0, 3)), 4))


def test_an_episode_fills_its_capacity_while_another_joins(lm, prompts):
    """Episode 0 feeds the last of its 12 positions in the step where episode 1 joins with 6 ids:
    the padding of that step must not overwrite episode 0's last position."""
    params = SamplingParams(temperature=0.7, max_new_tokens=4)
    turns = sampler(lm, 2, params, capacity=12)
    turns.start(TurnRequest(0, prompts[3], None, 4))  # 9 ids + 3 fed tokens: 12 positions
    for _ in range(3):
        assert turns.advance() == []
    turns.start(TurnRequest(1, prompts[0], None, 4))
    (first,) = turns.advance()
    assert first.key == 0
    assert_logps_equal_forward(lm, [torch.cat([prompts[3], first.ids])],
                               [{9 + i: lp for i, lp in enumerate(first.logps.tolist())}], 0.7)


def test_the_torch_engine_seeds_each_turn_by_its_mini_batch_and_slot(tmp_path):
    """`TorchRolloutEngine.turn_sampler`: turns seeded by the mini-batch (job seed, iteration,
    mini-batch) and the slot, so a second sampler for the same batch gives each episode the same
    tokens whatever order its turns start in; another mini-batch samples others. The engine's
    policy version, and env.stop_strings read with the checkpoint's tokenizer."""
    tokenizer = build_tokenizer()
    save_checkpoint(build_tiny(TinyModelConfig(num_hidden_layers=1), tokenizer, seed=0), tokenizer, tmp_path / "p")
    job = JobContext(build(RLJobConfig, tiny_job(tmp_path, "turns")), str(tmp_path / "p"), str(tmp_path / "weights"))
    ctx = StageContext("rollout", "rollout-0", [], [], lambda op, version: None,
                       logging.LoggerAdapter(logging.getLogger("test.turns"), {}), threading.Event())
    weights = RolloutWeights(job, "rollout-0")
    engine = TorchRolloutEngine(job, weights, ImageInputs(job, StageCounts(".", "r", "r", write=False)), ctx)

    def first_turns(batch: Batch, params: SamplingParams, order: list[int]) -> dict[int, TurnDone]:
        turns = engine.turn_sampler(batch, params, slots=2, capacity=16)
        done: dict[int, TurnDone] = {}
        for key in order:  # the second starts two steps after the first
            turns.start(TurnRequest(key, prompts[key], None, 6))
            for _ in range(2):
                done.update({turn.key: turn for turn in turns.advance()})
        while turns.busy:
            done.update({turn.key: turn for turn in turns.advance()})
        return done

    try:
        prompts = [torch.tensor([1, 9, 10, 11]), torch.tensor([1, 12])]
        batch = Batch(Handle("h", "rollout", 3, 1, policy_version=0, num_samples=2), ragged("prompt_ids", prompts))
        other = Batch(Handle("h2", "rollout", 3, 2, policy_version=0, num_samples=2), ragged("prompt_ids", prompts))
        params = SamplingParams(temperature=1.0, max_new_tokens=6)
        done = first_turns(batch, params, [0, 1])
        assert {k: t.ids.tolist() for k, t in first_turns(batch, params, [1, 0]).items()} == \
            {k: t.ids.tolist() for k, t in done.items()}
        assert [t.ids.tolist() for t in first_turns(other, params, [0, 1]).values()] != \
            [t.ids.tolist() for t in done.values()]
        assert done[0].policy_version == engine.policy_version == 0
        # env.stop_strings: the engine reads them with the checkpoint's tokenizer, as an environment reads turns
        stop = tokenizer.decode(done[0].ids[1:3], skip_special_tokens=True)
        assert len(stop) == 2 and stop not in tokenizer.decode(done[0].ids[:2], skip_special_tokens=True)
        stopped = first_turns(batch, replace(params, stop_strings=(stop,)), [0, 1])
        assert stopped[0].ids.tolist() == done[0].ids[:3].tolist() and stopped[0].finish_reason == "stop"
    finally:
        engine.close()
        weights.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: decode steps on cuda:0")
@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_turns_on_cuda_give_the_cpu_tokens(lm, prompts, graphs, temperature):
    """Greedy and sampled (the keyed draws are the same numbers on both devices), fp32 (TF32 off):
    staggered turns through the rollout engine's CUDA path (decode attention; one-token steps
    replayed as CUDA graphs, or eager steps over the turning episodes' rows, rows trading places as
    turns start and end) sample the CPU's eager tokens."""
    params = SamplingParams(temperature=temperature, max_new_tokens=5, stop_token_ids=STOPS)
    observations, waits = [torch.tensor([5, 6, 9])] * 4, [3, 0, 6, 1]
    cpu, _, _ = run_episodes(sampler(lm, 4, params), prompts, [None] * 4, observations, waits, 3, 5)
    model = copy.deepcopy(lm).cuda()
    use_decode_attention(model)
    static = StaticDecoder(graphs=True) if graphs else None
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        turns = TorchTurnSampler(model, 4, 64, params, (0,), 5, static)
        cuda, logps, _ = run_episodes(turns, prompts, [None] * 4, observations, waits, 3, 5)  # ids stay on the CPU
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    assert static is None or static.captures >= 1
    assert [c.tolist() for c in cuda] == [c.tolist() for c in cpu]
    assert_logps_equal_forward(lm, cpu, logps, 1.0)
