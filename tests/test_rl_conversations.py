"""A PPO job on a user's data as it comes: a Qwen2.5-VL checkpoint folder whose tokenizer has a
ChatML chat template and whose folder has preprocessor_config.json and generation_config.json,
trained on a Parquet dataset of conversations with images stored as bytes, the reference and an
extra column named by `data.fields`; and an env job on them whose tool answers are chat messages
of that template. Every stage is real, in one process on the real BrokerCore."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stream_rlhf.broker.runtime.inprocess import InProcessBus
from stream_rlhf.config import build, import_dotted
from stream_rlhf.data import shapes
from stream_rlhf.driver.dataflow import compile_job
from stream_rlhf.driver.warm_start import warm_start
from stream_rlhf.models.tokenizer import build_tokenizer
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.rl.task_data import resolve_data
from stream_rlhf.telemetry.metrics import read_metrics
from stream_rlhf.telemetry.stage_counts import read_stage_counts
from tests.rl_tiny import VISION, tiny_job
from tests.tiny_models import tiny_qwen2_5_vl

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
          "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
          "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
          "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LEVEL = 0.25


def level_reward(prompt: str, response: str, reference: str, level: float) -> float:
    """The extra column `level` as the reward: the metrics show it arrived."""
    return level


def _model_folder(folder: Path) -> None:
    tokenizer = build_tokenizer(vision=True)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.add_tokens(["\n"])
    tokenizer.chat_template = CHATML
    model = tiny_qwen2_5_vl()
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, tokenizer.eos_token_id],
                                                               "temperature": 0.9}))
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "patch_size": 8, "merge_size": 2, "temporal_patch_size": 2, "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5], "size": {"shortest_edge": 16 * 16, "longest_edge": 32 * 32}}))


def _dataset(path: Path, count: int) -> None:
    rows = []
    for problem in shapes.problems("train", count, seed=0):
        png = io.BytesIO()
        problem.image().save(png, format="PNG")
        question = problem.prompt.replace("<image>", "")
        rows.append({"messages": [{"role": "user", "content": [
            {"type": "image", "text": None, "image": {"bytes": png.getvalue(), "path": None}},
            {"type": "text", "text": question, "image": None}]}],
            "solution": problem.answer, "extra": {"level": LEVEL}})
    pq.write_table(pa.Table.from_pylist(rows), path)


def _run_in_process(cfg: RLJobConfig, weights: Path) -> None:
    """Every stage of `cfg` in this process, to the end; each mini-batch trained."""
    flow = compile_job(cfg, str(warm_start(cfg)), str(weights), vision_language=True)
    bus = InProcessBus(flow.topology, flow.broker, flow.admission)
    for stage_name, spec in flow.stages.items():
        bus.add(stage_name, import_dotted(spec.cls, "cls")(**spec.kwargs), spec.instances)
    stats = bus.run()
    assert stats["published.experience"] == cfg.iterations * cfg.rollout_batch.minibatches


@pytest.mark.slow
def test_ppo_on_parquet_conversations_through_the_chat_template(tmp_path):
    folder = tmp_path / "model"
    _model_folder(folder)
    _dataset(tmp_path / "train.parquet", 24)
    _dataset(tmp_path / "eval.parquet", 4)
    cfg = resolve_data(build(RLJobConfig, tiny_job(tmp_path, "chat", **{
        **VISION, "iterations": 2, "model.path": str(folder), "data.train": str(tmp_path / "train.parquet"),
        "data.eval": str(tmp_path / "eval.parquet"), "data.fields": {"reference": "solution", "level": "extra.level"},
        "data.min_pixels": None, "data.max_pixels": None,  # the folder's preprocessor_config.json
        "reward.function": "tests.test_rl_conversations:level_reward"})))
    assert cfg.rollout.temperature == 0.9  # from generation_config.json
    _run_in_process(cfg, tmp_path / "weights")
    records = read_metrics(Path(cfg.run_dir) / "metrics.jsonl")
    samples = cfg.rollout_batch.samples_per_minibatch * cfg.rollout_batch.minibatches
    assert len(records) == 2 and all(r["samples"] == samples for r in records)
    assert all(r["reward"] == pytest.approx(LEVEL) for r in records)  # the extra column reached the function
    counts = read_stage_counts(Path(cfg.run_dir))
    assert counts["prompts"]["images_seen"] == cfg.iterations * samples


def _env_job(tmp_path: Path, name: str, env: dict, **overrides: object) -> list[dict]:
    """The user's folder and data in an env job with `env`, run in this process: every episode ends
    without failing; the samples log."""
    folder = tmp_path / "model"
    _model_folder(folder)
    _dataset(tmp_path / "train.parquet", 24)
    _dataset(tmp_path / "eval.parquet", 4)
    cfg = resolve_data(build(RLJobConfig, tiny_job(tmp_path, name, env=env, **{
        **VISION, "iterations": 2, "model.path": str(folder), "data.train": str(tmp_path / "train.parquet"),
        "data.eval": str(tmp_path / "eval.parquet"), "data.fields": {"reference": "solution"},
        "data.min_pixels": None, "data.max_pixels": None, "model.tiny.max_position_embeddings": 96,
        "reward.function": None, **overrides})))
    _run_in_process(cfg, tmp_path / "weights")
    counts = read_stage_counts(Path(cfg.run_dir))
    assert not [key for key in counts["rollout"] if key.startswith("episodes_failed.")], counts["rollout"]
    return [json.loads(line) for line in (Path(cfg.run_dir) / "samples.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_an_env_job_writes_tool_observations_as_chat_messages_of_the_template(tmp_path):
    """The same user's folder and data in an env job whose environment answers each turn with a
    `tool` message (`tests.episode_envs:Messages`): rollout writes it as the tokenizer's ChatML
    template does, and every episode is trained."""
    env = {"factory": "tests.episode_envs:Messages", "options": {"turns": 2}, "max_turns": 2, "max_episode_tokens": 96}
    samples = _env_job(tmp_path, "chat_env", env)
    message = "\n<|im_start|>tool\n=19<|im_end|>\n<|im_start|>assistant\n"
    observations = [(sample["tokens"], a, b) for sample in samples for a, b, kind in sample["turns"]
                    if kind == "observation"]
    assert observations
    for tokens, a, b in observations:
        # the policy's turn is closed once: by its own <|im_end|>, or by the observation's first token
        assert (tokens[a - 1] == "<|im_end|>") != (tokens[a] == "<|im_end|>"), tokens
        assert "".join(tokens[a:b]).removeprefix("<|im_end|>") == message


@pytest.mark.slow
def test_a_tool_job_describes_env_tools_in_every_prompt_through_the_template(tmp_path):
    """`env.tools` with the embedded ToolCalls environment: the template file named by
    `data.chat_template` writes the tools' names into each prompt, and every episode is trained."""
    template = tmp_path / "tools.jinja"
    template.write_text("{% if tools %}<|im_start|>system\ntools:{% for tool in tools %} {{ tool.function.name }}"
                        "{% endfor %}<|im_end|>\n{% endif %}" + CHATML)
    env = {"factory": "stream_rlhf.envs.tool_calls:ToolCalls", "tools": ["tests.episode_envs:add"],
           "options": {"reward": "tests.episode_envs:exact"}, "max_turns": 2, "max_episode_tokens": 96}
    samples = _env_job(tmp_path, "chat_tools", env, **{"data.chat_template": str(template)})
    assert samples and all(s["prompt"].startswith("<|im_start|>system\ntools: add<|im_end|>\n<|im_start|>user\n")
                           for s in samples)
