"""The embedded multi-turn examples (issue 34 item 5): the tool_sums task and its demonstrations,
the shapes_dialogue task and its environment, the warm start's multi-turn batches (policy tokens
trained, observations not), its cache keys, and the two example configs."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import torch

from stream_rlhf.config import ConfigError, load_config
from stream_rlhf.data import shapes, shapes_dialogue, tool_sums
from stream_rlhf.data.demonstration import IGNORE, answer_only, demonstration_rows, observation, policy
from stream_rlhf.driver.evaluate import evaluate
from stream_rlhf.driver.warm_start import _cache_folder, _sample_demonstration, _sft_batch
from stream_rlhf.envs import calculator
from stream_rlhf.envs.environment import EpisodeStart, Observation, Turn
from stream_rlhf.envs.shapes_dialogue import ShapesDialogue
from stream_rlhf.models.checkpoint import build_tiny, save_checkpoint
from stream_rlhf.models.tokenizer import build_tokenizer
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.rl.task_data import open_prompts, resolve_data

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
TOKENIZER = build_tokenizer()


def test_tool_sums_prompts_references_and_splits():
    train = tool_sums.problems("train", 400, seed=0, max_operand=999)
    assert train == tool_sums.problems("train", 400, seed=0, max_operand=999)
    assert train != tool_sums.problems("train", 400, seed=1, max_operand=999)
    terms = set()
    for problem in train:
        assert re.fullmatch(r"\d{1,3}(\+\d{1,3}){2,3}=", problem.prompt), problem.prompt
        operands = [int(x) for x in problem.prompt.removesuffix("=").split("+")]
        assert max(operands) <= 999 and problem.answer == str(sum(operands))
        terms.add(len(operands))
    assert terms == {3, 4}
    evaluation = {p.prompt for p in tool_sums.problems("eval", 200, seed=0, max_operand=999)}
    assert not evaluation & {p.prompt for p in train}


def test_tool_sums_demonstrations_match_the_calculator():
    """A demonstration's call gets the observation it shows from the real calculator, and its
    final answer earns the full reward."""
    assert tool_sums.CALL_PREFIX == calculator.CALL_PREFIX
    batch = tool_sums.problems("train", 200, seed=0, max_operand=999)
    demonstrations = tool_sums.demonstrations(batch, tool_fraction=0.5, seed=1)
    assert demonstrations == tool_sums.demonstrations(batch, tool_fraction=0.5, seed=1)
    with_tool = [len(d) == 3 for d in demonstrations]
    assert 60 < sum(with_tool) < 140
    assert not any(len(d) == 3 for d in tool_sums.demonstrations(batch, 0.0, seed=1))
    for problem, demonstration in zip(batch[:20], demonstrations[:20]):
        env = calculator.Calculator()
        asyncio.run(env.reset(EpisodeStart(problem.prompt, problem.answer)))
        for segment, following in zip(demonstration, (*demonstration[1:], None)):
            if not segment.trained:
                continue
            turn = asyncio.run(env.step(segment.text, TOKENIZER.encode(segment.text, add_special_tokens=False)))
            if following is None:
                assert turn.done and turn.reward == 1.0
            else:
                assert not turn.done and turn.observation == Observation(following.text)


def test_demonstration_rows_train_policy_turns_only():
    prompt = [TOKENIZER.bos_token_id, *TOKENIZER.encode("1+2+3=", add_special_tokens=False)]
    demonstration = (policy("calc:1+2+3"), observation("=6"), policy("6"))
    ids, labels = demonstration_rows(TOKENIZER, prompt, demonstration)
    eos = TOKENIZER.eos_token_id
    assert TOKENIZER.decode(ids) == "<bos>1+2+3=calc:1+2+3<eos>=6" + "6<eos>"
    call, result = len(prompt) + len("calc:1+2+3") + 1, len("=6")
    assert labels[:len(prompt)] == [IGNORE] * len(prompt)
    assert labels[len(prompt):call] == ids[len(prompt):call] and ids[call - 1] == eos
    assert labels[call:call + result] == [IGNORE] * result
    assert labels[call + result:] == ids[call + result:] == [*TOKENIZER.encode("6", add_special_tokens=False), eos]


def test_single_turn_warm_start_batch_is_unchanged():
    """Answer-only demonstrations give exactly the tokens and labels the warm start always made."""
    prompts = [torch.tensor([1, 5, 6]), torch.tensor([1, 7])]
    batch = _sft_batch(TOKENIZER, prompts, [answer_only("42"), answer_only("7")])
    four, two, seven = (TOKENIZER.convert_tokens_to_ids(c) for c in "427")
    eos, pad = TOKENIZER.eos_token_id, TOKENIZER.pad_token_id
    assert batch["input_ids"].tolist() == [[1, 5, 6, four, two, eos], [1, 7, seven, eos, pad, pad]]
    assert batch["labels"].tolist() == [[-100, -100, -100, four, two, eos], [-100, -100, seven, eos, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1] * 6, [1, 1, 1, 1, 0, 0]]


@pytest.mark.parametrize("config, key", [
    ("text_grpo", "tiny-3368b3dd1dc2a57d"),
    ("text_ppo", "tiny-3368b3dd1dc2a57d"),
    ("text_ppo_steps", "tiny-7c1865e123d5be7f"),
    ("mllm_ppo", "tiny-f59c139c4007e9e5"),
])
def test_shipped_warm_starts_keep_their_cache_keys(config, key):
    """The keys the shipped configs had before the multi-turn tasks: their cached warm starts stay valid."""
    folder, _ = _cache_folder(load_config(RLJobConfig, CONFIGS / f"{config}.yaml", []))
    assert folder.name == key


def test_tool_sums_warm_start_has_its_own_cache_key():
    tool = load_config(RLJobConfig, CONFIGS / "text_tool_grpo.yaml", [])
    no_tool = load_config(RLJobConfig, CONFIGS / "text_tool_grpo.yaml", ["task.tool_fraction=0"])
    grpo = load_config(RLJobConfig, CONFIGS / "text_grpo.yaml", [])
    keys = {_cache_folder(cfg)[0].name for cfg in (tool, no_tool, grpo)}
    assert len(keys) == 3


def _dialogue_start(tmp_path, squares, row, column) -> EpisodeStart:
    problem = shapes.Problem(f"<image>color at {row} {column}?", "", squares)
    path = tmp_path / "image.png"
    problem.image().save(path)
    color = next(c for r, k, c in squares if (r + 1, k + 1) == (row, column))
    return EpisodeStart(problem.prompt, color, images=(str(path),))


def test_shapes_dialogue_second_question_follows_the_first_answer(tmp_path):
    squares = ((0, 0, "red"), (1, 2, "red"), (2, 3, "blue"))
    start = _dialogue_start(tmp_path, squares, 1, 1)
    env = ShapesDialogue()
    env.reset(start)
    first = env.step("red", [])
    assert first.observation == Observation("how many red?") and first.reward == 1.0 and not first.done
    second = env.step("2", [])
    assert second.observation is None and second.reward == 1.0 and second.done

    env = ShapesDialogue()  # a wrong colour: the question is about it, and so is the right count
    env.reset(start)
    first = env.step("blue", [])
    assert first.observation == Observation("how many blue?") and first.reward == 0.1
    assert env.step("1", []).reward == 1.0  # one blue square

    env = ShapesDialogue()  # no colour to ask about: the episode ends
    env.reset(start)
    ended = env.step("3", [])
    assert ended.done and ended.observation is None and ended.reward == 0.0


def test_shapes_dialogue_problems_and_demonstrations(tmp_path):
    batch = shapes_dialogue.problems("train", 100, seed=0)
    assert batch == shapes_dialogue.problems("train", 100, seed=0)
    assert not {p.squares for p in batch} & {p.squares for p in shapes_dialogue.problems("eval", 50, seed=0)}
    for problem in batch:
        row, column = (int(x) for x in re.fullmatch(r"<image>color at (\d) (\d)\?", problem.prompt).groups())
        assert (row - 1, column - 1, problem.answer) in problem.squares
    problem = batch[0]
    problem.image().save(tmp_path / "one.png")
    assert shapes.read_squares(tmp_path / "one.png") == problem.squares
    first, question, second = shapes_dialogue.demonstration(problem.answer, problem.squares)
    assert (first.trained, question.trained, second.trained) == (True, False, True)
    assert question.text == f"how many {problem.answer}?"
    assert second.text == str(sum(c == problem.answer for *_, c in problem.squares))


def test_example_configs_build():
    tool = load_config(RLJobConfig, CONFIGS / "text_tool_grpo.yaml", [])
    assert tool.env.factory == "stream_rlhf.envs.calculator:Calculator" and tool.reward.function is None
    assert tool.task.name == "tool_sums" and callable(tool.env.make().step)
    no_tool = load_config(RLJobConfig, CONFIGS / "text_tool_grpo.yaml",
                          ["env=null", "reward.function=stream_rlhf.data.arithmetic:reward", "task.tool_fraction=0"])
    assert no_tool.env is None and no_tool.task.tool_fraction == 0.0
    dialogue = load_config(RLJobConfig, CONFIGS / "mllm_multiturn_ppo.yaml", [])
    assert dialogue.task.name == "shapes_dialogue" and isinstance(dialogue.env.make(), ShapesDialogue)
    with pytest.raises(ConfigError, match="reward.function=None, reward.model_path=None: a reward function"):
        load_config(RLJobConfig, CONFIGS / "text_tool_grpo.yaml", ["env=null"])
    with pytest.raises(ConfigError, match="tool_fraction=0.2: only the tool_sums task has it"):
        load_config(RLJobConfig, CONFIGS / "text_grpo.yaml", ["task.tool_fraction=0.2"])


def test_shapes_dialogue_files_and_their_warm_start_demonstrations(tmp_path):
    cfg = load_config(RLJobConfig, CONFIGS / "mllm_multiturn_ppo.yaml",
                      [f"task.data_dir={tmp_path}", "task.train_prompts=6", "task.eval_prompts=3"])
    cfg = resolve_data(cfg)
    assert Path(cfg.data.train).parent.name.startswith("shapes_dialogue-")
    tokenizer = build_tokenizer(vision=True)
    model = build_tiny(cfg.model.tiny, tokenizer, seed=0)
    dataset = open_prompts(cfg, model.config, tokenizer, "train")
    for _ in range(6):
        sample = dataset.next_sample()
        squares = shapes.read_squares(sample.image_paths[0])
        assert re.fullmatch(r"<image>color at \d \d\?", sample.prompt) and sample.answer in shapes.COLORS
        demonstration = _sample_demonstration(cfg.task, sample)
        assert demonstration == shapes_dialogue.demonstration(sample.answer, squares)
        env = ShapesDialogue()  # the environment agrees with the demonstration, turn by turn
        env.reset(EpisodeStart(sample.prompt, sample.answer, sample.image_paths))
        assert env.step(demonstration[0].text, []) == Turn(Observation(demonstration[1].text), 1.0)
        assert env.step(demonstration[2].text, []) == Turn(None, 1.0, done=True)


class AlwaysAsks:
    """A scripted environment: one follow-up question whatever the answer, then done (reward 0.5
    per turn), so every episode has two policy turns."""

    def reset(self, start: EpisodeStart) -> None:
        self.turns = 0

    def step(self, text: str, token_ids: list[int]) -> Turn:
        self.turns += 1
        return Turn(Observation("how many?"), 0.5) if self.turns == 1 else Turn(None, 0.5, done=True)


@pytest.mark.parametrize("config, sets", [
    ("text_tool_grpo", []),
    ("mllm_multiturn_ppo", []),
    ("mllm_multiturn_ppo", ["env.factory=tests.test_env_examples:AlwaysAsks"]),
])
def test_evaluate_scores_episodes(config, sets, tmp_path):
    """`evaluate` of an env job runs its episodes (a vision-language one with the image's features
    on every turn)."""
    cfg = resolve_data(load_config(RLJobConfig, CONFIGS / f"{config}.yaml", [
        f"task.data_dir={tmp_path}", "task.train_prompts=2", "task.eval_prompts=4", "rollout.max_new_tokens=4", *sets]))
    tokenizer = build_tokenizer(vision=cfg.model.tiny.vision is not None)
    save_checkpoint(build_tiny(cfg.model.tiny, tokenizer, seed=0), tokenizer, tmp_path / "policy")
    result = evaluate(cfg, str(tmp_path / "policy"))
    assert result["prompts"] == 4 and 0 < result["response_tokens"] <= 2 * 4 * cfg.env.max_turns * 4
    assert 0.0 <= result["reward"] <= cfg.env.max_turns and 0.0 <= result["greedy_reward"] <= cfg.env.max_turns
    if sets:  # two turns of every episode, 0.5 each
        assert result["reward"] == result["greedy_reward"] == 1.0 and result["response_tokens"] >= 2 * 4 * 2
