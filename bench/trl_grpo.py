"""TRL's side of bench/vs_trl.py: GRPOTrainer on a stream-rlhf checkpoint and the arithmetic task.

    .venv-trl/bin/python bench/trl_grpo.py --checkpoint runs/.cache/<warm start> --steps 20 \
        --prompts 16 --samples 4 --max-new-tokens 5 --lr 2e-4 --out /tmp/trl.json [--min-new-tokens 48] \
        [--device cuda] [--lora-rank 8]

Runs in TRL's own environment (see bench/vs_trl.py for the one-line setup); it imports only
`stream_rlhf.data.arithmetic` from this repository (put on sys.path here), for the same prompts
and the same reward rule. One optimizer step per step (16 prompts x 4 samples), no KL (beta=0),
temperature 1. Writes per step: wall seconds, tokens (prompt + completion), mean reward.

`--lora-rank R` trains PEFT LoRA adapters (alpha 2R, every projection of the decoder layers, no
dropout), as `actor.lora` does on our side. Precision is explicit: fp32 unless `--bf16`
(GRPOConfig's own default is bf16 mixed precision, also on the CPU, which the rows of
bench/vs_trl.py before 2026-11-26 ran against our fp32).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from stream_rlhf.data.arithmetic import problems, reward


class StepClock(TrainerCallback):
    """Wall time of every optimizer step (generation, scoring, forward, backward, update)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.started = 0.0

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.seconds.append(time.perf_counter() - self.started)


def arithmetic_reward(prompts: list[str], completions: list[str], answer: list[str], **_: object) -> list[float]:
    return [reward(p, c, a) for p, c, a in zip(prompts, completions, answer)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=5)
    parser.add_argument("--min-new-tokens", type=int, default=0, help="> 0: fixed-length answers (EOS suppressed)")
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (autocast); default fp32")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: use_cpu=False")
    parser.add_argument("--lora-rank", type=int, default=0, help="> 0: train PEFT LoRA adapters of this rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32)
    count = args.prompts * args.steps
    data = problems("train", count, args.seed)
    dataset = Dataset.from_dict({"prompt": [tokenizer.bos_token + p.prompt for p in data],
                                 "answer": [p.answer for p in data]})
    generation = {"min_new_tokens": args.min_new_tokens} if args.min_new_tokens else None
    config = GRPOConfig(
        output_dir=str(Path(args.out).with_suffix(".trainer")), max_steps=args.steps, seed=args.seed,
        per_device_train_batch_size=args.prompts * args.samples, num_generations=args.samples,
        steps_per_generation=1, num_iterations=1, gradient_accumulation_steps=1,
        max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, beta=0.0,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        logging_steps=1, report_to=[], save_strategy="no", use_cpu=args.device == "cpu",
        shuffle_dataset=False,
        generation_kwargs=generation, disable_tqdm=True, dataloader_num_workers=0, bf16=args.bf16,
    )
    clock = StepClock()
    peft_config = None
    if args.lora_rank:
        from peft import LoraConfig  # in TRL's environment (scripts/setup_trl.sh)

        peft_config = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0,
                                 task_type="CAUSAL_LM", target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                        "gate_proj", "up_proj", "down_proj"])
    trainer = GRPOTrainer(model=model, reward_funcs=arithmetic_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[clock], peft_config=peft_config)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    cumulative = [int(entry["num_tokens"]) for entry in logs]
    tokens = [b - a for a, b in zip([0, *cumulative], cumulative)]
    result = {
        "step_s": clock.seconds,
        "tokens": tokens,
        "reward": [float(entry["reward"]) for entry in logs],
        "completion_len": [float(entry["completions/mean_length"]) for entry in logs],
        "threads": torch.get_num_threads(),
        "bf16": trainer.args.bf16,
    }
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
