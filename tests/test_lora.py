"""LoRA adapters (`models/lora.py`) and the torch engine training them (`actor.lora`,
`critic.lora`): the model starts unchanged, only the adapters (and a critic's head) train, every
export is the merged plain model, a resume state keeps the adapters apart and resumes exactly,
and a saved adapter is one PEFT loads."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from stream_rlhf.algos.losses import value_loss
from stream_rlhf.backends.optimizer_config import OptimizerConfig
from stream_rlhf.backends.torch_engine import TorchTrainEngine
from stream_rlhf.distributed import RankGroup
from stream_rlhf.models.lora import LoRALinear, adapters_off, add_lora, merge_lora, merged_names
from stream_rlhf.models.lora_config import LoRAConfig
from stream_rlhf.models.tokenizer import build_tokenizer
from tests.test_torch_engine import LORA as ATTENTION
from tests.test_torch_engine import VOCAB, _critic, _experience, _loss, _model

PEFT_PYTHON = Path(__file__).resolve().parent.parent / ".venv-trl" / "bin" / "python"
"""TRL's environment (scripts/setup_trl.sh) has PEFT: the reader a saved adapter is for."""
PEFT_MERGE = """
import sys, torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
base = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
merged = PeftModel.from_pretrained(base, sys.argv[2] + "/adapter").merge_and_unload().state_dict()
ours = load_file(sys.argv[2] + "/model.safetensors")
assert merged.keys() >= ours.keys(), sorted(ours.keys() - merged.keys())
print(max((merged[k] - ours[k]).abs().max().item() for k in ours))
"""


def _lora_model() -> torch.nn.Module:
    return _model(ATTENTION)


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_adapters_start_at_the_checkpoint_and_alone_train():
    plain, adapted = _model(), _model()
    wrapped = add_lora(adapted, ATTENTION, seed=0)
    assert wrapped == [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    ids = torch.randint(1, VOCAB, (2, 7))
    assert torch.equal(_logits(adapted, ids), _logits(plain, ids))  # B = 0
    trained = {name for name, p in adapted.named_parameters() if p.requires_grad}
    assert trained == {f"{w}.lora_{ab}" for w in wrapped for ab in "AB"}
    assert merged_names(adapted) == [f"{w}.weight" for w in wrapped]


def test_the_merged_weights_are_the_adapted_model():
    adapted = _lora_model()
    for module in adapted.modules():
        if isinstance(module, LoRALinear):
            torch.nn.init.normal_(module.lora_B, std=0.05)
    merged = merge_lora(adapted.state_dict())
    assert not any("lora" in key for key in merged) and merged.keys() == _model().state_dict().keys()
    plain = _model()
    plain.load_state_dict(merged)
    ids = torch.randint(1, VOCAB, (2, 7))
    torch.testing.assert_close(_logits(plain, ids), _logits(adapted, ids), atol=1e-5, rtol=0)
    assert merge_lora(merged) is merged  # no adapters: as it is


def test_with_the_adapters_off_the_model_is_its_base_and_the_engine_gives_the_base_log_probs():
    """`adapters_off`: the starting checkpoint's outputs exactly, after the adapters have moved; the
    engine's `forward_response_logprobs(base=True)` (algorithm.kl.reference lora_base) likewise,
    and it refuses a model without adapters."""
    plain = _model()
    engine = TorchTrainEngine(_lora_model(), RankGroup.single(), OptimizerConfig(lr=1e-2))
    exp = _experience()
    advantages = torch.linspace(-1, 1, exp.num_samples)[:, None].expand_as(exp.mask).contiguous()
    engine.train_step(exp, _loss(engine), {"advantages": advantages})
    ids = torch.randint(1, VOCAB, (2, 7))
    assert not torch.equal(_logits(engine.model, ids), _logits(plain, ids))  # the adapters moved
    with adapters_off(engine.model):
        assert torch.equal(_logits(engine.model, ids), _logits(plain, ids))
    assert not torch.equal(_logits(engine.model, ids), _logits(plain, ids))  # on again after the block
    reference = TorchTrainEngine(_model(), RankGroup.single())
    torch.testing.assert_close(engine.forward_response_logprobs(exp, 0.7, base=True),
                               reference.forward_response_logprobs(exp, 0.7), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="has no LoRA adapters"):
        reference.forward_response_logprobs(exp, 0.7, base=True)


def test_a_target_the_layers_lack_is_named():
    with pytest.raises(ValueError, match=r"\['qkv'\] name no linear layer.*'q_proj'"):
        add_lora(_model(), LoRAConfig(target_modules=["q_proj", "qkv"]), seed=0)


def test_the_engine_trains_the_adapters_and_exports_merged_weights(tmp_path):
    start = _model().state_dict()
    engine = TorchTrainEngine(_lora_model(), RankGroup.single(), OptimizerConfig(lr=1e-2))
    exp = _experience()
    advantages = torch.linspace(-1, 1, exp.num_samples)[:, None].expand_as(exp.mask).contiguous()
    for _ in range(2):
        engine.train_step(exp, _loss(engine), {"advantages": advantages})
    adapted = [m for m in engine.model.modules() if isinstance(m, LoRALinear)]
    assert sum(s["exp_avg"].numel() for s in engine.optimizer.state.values()) == sum(  # optimizer state: adapters'
        p.numel() for p in engine.trainable) == sum(4 * (m.in_features + m.out_features) for m in adapted)
    full = engine.export_weights()
    assert full.keys() == start.keys()
    changed = {name for name in start if not torch.equal(full[name], start[name])}
    assert changed == set(engine.trained_names()) == set(merged_names(engine.model))
    sent = engine.export_weights(trainable_only=True)
    assert list(sent) == engine.trained_names() and all(torch.equal(sent[k], full[k]) for k in sent)
    snapshot = engine.snapshot_weights()
    assert snapshot.keys() == full.keys() and all(torch.equal(snapshot[k], full[k]) for k in full)

    # a plain model with the exported weights computes the engine's log-probs (what rollout samples from)
    plain = TorchTrainEngine(_model(), RankGroup.single())
    plain.model.load_state_dict(full)
    torch.testing.assert_close(plain.forward_logprobs(exp.sequences, 1.0), engine.forward_logprobs(exp.sequences, 1.0),
                               atol=1e-5, rtol=0)

    # a resume state keeps the adapters apart and trains on exactly as the engine does
    state = engine.snapshot_state()
    assert any(key.endswith("lora_A") for key in state["model"])
    assert torch.equal(state["model"]["model.layers.0.self_attn.q_proj.weight"],
                       start["model.layers.0.self_attn.q_proj.weight"])  # the base, frozen
    torch.save(state, tmp_path / "engine.pt")
    resumed = TorchTrainEngine(_lora_model(), RankGroup.single(), OptimizerConfig(lr=1e-2))
    resumed.load_state(tmp_path / "engine.pt")
    for trainer in (engine, resumed):
        trainer.train_step(exp, _loss(trainer), {"advantages": advantages})
    a, b = engine.export_weights(), resumed.export_weights()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert merge_lora(torch.load(tmp_path / "engine.pt", weights_only=True)["model"]).keys() == start.keys()


def test_a_saved_folder_is_the_plain_merged_model(tmp_path):
    engine = TorchTrainEngine(_lora_model(), RankGroup.single(), OptimizerConfig(lr=1e-2))
    exp = _experience()
    engine.train_step(exp, _loss(engine), {"advantages": torch.ones_like(exp.mask)})
    engine.save(Path(tmp_path / "folder"), build_tokenizer())
    reloaded = type(_model()).from_pretrained(str(tmp_path / "folder"))
    assert not any("lora" in key for key in reloaded.state_dict())
    weights = engine.export_weights()
    assert all(torch.equal(reloaded.state_dict()[k], weights[k]) for k in weights)
    again = TorchTrainEngine(_lora_model(), RankGroup.single(), OptimizerConfig(lr=1e-2))
    again.load(tmp_path / "folder")  # the merged weights become the base, the adapters start again at zero
    assert all(torch.equal(again.export_weights()[k], weights[k]) for k in weights)


def test_a_critics_adapters_train_with_its_whole_value_head():
    """critic.lora: the head (`score`) trains whole beside the adapters, and is sent with the
    merged weights."""
    critic = _critic()
    add_lora(critic, ATTENTION, seed=0, key="critic.lora")
    engine = TorchTrainEngine(critic, RankGroup.single(), OptimizerConfig(lr=1e-2))
    exp = _experience()
    exp.values = torch.zeros_like(exp.mask)
    returns = torch.linspace(-1, 1, exp.num_samples)[:, None].expand_as(exp.mask).contiguous()

    def loss_fn(part, per_sample):
        return value_loss(engine.response_values(part), part.values, per_sample["returns"], part.mask, 10.0)

    for _ in range(2):
        engine.train_step(exp, loss_fn, {"returns": returns})
    start = _critic().state_dict()
    full = engine.export_weights()
    assert full.keys() == start.keys()
    assert {name for name in start if not torch.equal(full[name], start[name])} == set(engine.trained_names())
    head = ["score.weight", "score.bias"]
    assert [n for n in engine.trained_names() if not n.endswith(("q_proj.weight", "v_proj.weight"))] == head
    trained, total = engine.parameter_counts()
    head_size = sum(start[name].numel() for name in head)
    assert trained == sum(p.numel() for p in engine.trainable) > head_size
    assert total == sum(t.numel() for t in start.values()) + trained - head_size  # the base, the adapters beside it


@pytest.mark.slow
@pytest.mark.skipif(not PEFT_PYTHON.exists(), reason="needs TRL's environment .venv-trl with PEFT: run "
                    "scripts/setup_trl.sh")
def test_the_saved_adapter_is_one_peft_loads_onto_the_starting_checkpoint(tmp_path):
    _model().save_pretrained(tmp_path / "base")
    engine = TorchTrainEngine(_lora_model(), RankGroup.single(), OptimizerConfig(lr=1e-2))
    exp = _experience()
    for _ in range(2):
        engine.train_step(exp, _loss(engine), {"advantages": torch.ones_like(exp.mask)})
    engine.save(tmp_path / "trained", build_tokenizer())
    done = subprocess.run([str(PEFT_PYTHON), "-c", PEFT_MERGE, str(tmp_path / "base"), str(tmp_path / "trained")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.split()[-1]) < 1e-6  # PEFT's merge of our adapter is our merged policy
