"""A process reward model (PRM): token classification scoring each step of a response at its end
token, and a tiny one trained on the project's own multi-step arithmetic.

    prm = load_prm(folder)                                   # for reward.process.model_path
    train_tiny_prm(folder, base, steps=300)                  # writes a PRM checkpoint folder

    python -m stream_rlhf.models.prm OUT_DIR --base POLICY_DIR [--steps 300] [--terms 3] [--max-operand 30]

Training data: the task's train problems with responses made from the right partial sums, each
step replaced by a wrong number with probability 1/2 (a near miss or a random number); the label
of a step is whether it is the right partial sum, the loss a binary cross-entropy on the logit at
each step's end token (the separator, or the end-of-sequence token after the last step). The
PRM starts from a policy checkpoint `base` (the warm-started tiny model, which can already add:
a PRM trained from a random initialisation barely beats chance at this size) with a new one-label
head, and shares its tokenizer, so it reads the policy's token ids as they are.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from pathlib import Path

import torch
from transformers import AutoModelForTokenClassification, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from stream_rlhf.algos.process_rewards import step_ends
from stream_rlhf.data.arithmetic import problems
from stream_rlhf.data.tokenizer import load_tokenizer

log = logging.getLogger(__name__)
SEPARATOR = ","


def load_prm(path: str | Path) -> PreTrainedModel:
    """A token-classification checkpoint with one label, in eval mode."""
    model = AutoModelForTokenClassification.from_pretrained(str(path), dtype=torch.float32)
    if model.config.num_labels != 1:
        raise ValueError(f"PRM {path}: {model.config.num_labels} labels, expected 1 (a logit per token)")
    return model.eval()


def corrupted_steps(answer: str, rng: random.Random) -> tuple[list[str], list[float]]:
    """The steps of `answer` with each replaced by a wrong number with probability 1/2, and the label
    of each (1.0 right, 0.0 wrong)."""
    steps, labels = [], []
    for step in answer.split(SEPARATOR):
        if rng.random() < 0.5:
            value = int(step)
            wrong = rng.choice([value + rng.choice([-10, -1, 1, 10]), rng.randint(0, 2 * value + 10)])
            if wrong != value and wrong >= 0:
                steps.append(str(wrong))
                labels.append(0.0)
                continue
        steps.append(step)
        labels.append(1.0)
    return steps, labels


def _batch(tokenizer: PreTrainedTokenizerBase, items: list[tuple[str, list[str], list[float]]]
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, L) ids and mask, and (B, L) targets: a step's label at its end token, -1 elsewhere."""
    separator = tokenizer.convert_tokens_to_ids(SEPARATOR)
    rows, targets = [], []
    for prompt, steps, labels in items:
        prompt_ids = [tokenizer.bos_token_id, *tokenizer.encode(prompt, add_special_tokens=False)]
        response = [*tokenizer.encode(SEPARATOR.join(steps), add_special_tokens=False), tokenizer.eos_token_id]
        target = [-1.0] * (len(prompt_ids) + len(response))
        for end, label in zip(step_ends(torch.tensor(response), separator).tolist(), labels):
            target[len(prompt_ids) + end] = label
        rows.append(prompt_ids + response)
        targets.append(target)
    length = max(map(len, rows))
    ids = torch.tensor([r + [tokenizer.pad_token_id] * (length - len(r)) for r in rows])  # (B, L)
    mask = torch.tensor([[1] * len(r) + [0] * (length - len(r)) for r in rows])  # (B, L)
    labels = torch.tensor([t + [-1.0] * (length - len(t)) for t in targets])  # (B, L)
    return ids, mask, labels


def step_accuracy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                  items: list[tuple[str, list[str], list[float]]]) -> float:
    """The share of steps whose sigmoid(logit) > 0.5 matches the label."""
    ids, mask, labels = _batch(tokenizer, items)
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=mask).logits[..., 0]  # (B, L)
    scored = labels >= 0
    return ((logits[scored] > 0).float() == labels[scored]).float().mean().item()


def labelled(split: str, count: int, seed: int, max_operand: int,
             terms: int) -> list[tuple[str, list[str], list[float]]]:
    """(prompt, steps, labels) of `count` problems of `split`, each step made wrong with probability 1/2."""
    rng = random.Random(f"prm/{split}/{seed}")
    return [(p.prompt, *corrupted_steps(p.answer, rng)) for p in problems(split, count, seed, max_operand, terms)]


def train_tiny_prm(folder: str | Path, base: str | Path, steps: int = 300, batch_size: int = 64,
                   lr: float = 1e-3, max_operand: int = 30, terms: int = 3, seed: int = 0) -> dict[str, float]:
    """Train a PRM from the policy checkpoint `base` on corrupted multi-step answers and save it
    (weights and tokenizer) in `folder`; returns its step accuracy on held-out problems and the
    settings, also written to `folder`/prm.json."""
    tokenizer = load_tokenizer(base)
    torch.manual_seed(seed)
    hf_logging.set_verbosity_error()  # the new head is reported as "missing" from the checkpoint
    model = AutoModelForTokenClassification.from_pretrained(str(base), num_labels=1, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    data = labelled("train", steps * batch_size, seed, max_operand, terms)
    started = time.monotonic()
    model.train()
    for step in range(steps):
        ids, mask, labels = _batch(tokenizer, data[step * batch_size:(step + 1) * batch_size])
        logits = model(input_ids=ids, attention_mask=mask).logits[..., 0]  # (B, L)
        scored = labels >= 0
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits[scored], labels[scored])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if (step + 1) % 100 == 0 or step + 1 == steps:
            log.info("PRM: step %d/%d, loss %.3f, %.0fs", step + 1, steps, loss.item(), time.monotonic() - started)
    model.eval()
    accuracy = step_accuracy(model, tokenizer, labelled("eval", 256, seed, max_operand, terms))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    result = {"step_accuracy": round(accuracy, 4), "base": str(base), "steps": steps, "max_operand": max_operand,
              "terms": terms}
    (Path(folder) / "prm.json").write_text(json.dumps(result, indent=1))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description="Train a tiny PRM on multi-step arithmetic.")
    parser.add_argument("out", help="the checkpoint folder to write")
    parser.add_argument("--base", required=True, help="the policy checkpoint folder it starts from")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--terms", type=int, default=3)
    parser.add_argument("--max-operand", type=int, default=30)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s prm %(message)s")
    result = train_tiny_prm(args.out, args.base, args.steps, max_operand=args.max_operand, terms=args.terms)
    log.info("PRM written to %s: step accuracy %.3f on held-out problems", args.out, result["step_accuracy"])


if __name__ == "__main__":
    main()
