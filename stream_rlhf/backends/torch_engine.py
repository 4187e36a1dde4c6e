"""The `torch` train engine: a Hugging Face model on this rank's device, FSDP2 across the ranks.

    engine = TorchTrainEngine(load_policy(path), ctx.group, optimizer=cfg.actor)   # trains: sharded
    engine = TorchTrainEngine(load_critic(path), ctx.group)                        # forward only: replicated

A training engine of several ranks shards its model with FSDP2 (`fully_shard` on every decoder
layer, then on the whole): each rank holds 1/world of the parameters, gradients and optimizer
state, and each optimizer step's samples are split over the ranks. Each rank's loss is scaled by
its share of the step's response tokens, so the averaged gradient is exactly that of the token
mean over all samples, as on one rank. A forward-only engine keeps a whole copy of the model on
every rank (data parallel: each rank computes its share of a mini-batch, then all gather).

A model with LoRA adapters (`models/lora.py`, added by `engines.build_train_engine` for
`actor.lora` and `critic.lora`) trains the adapters alone (and a critic's head); every export
(weights for rollout, checkpoint folders) merges them into the weights, while a resume state keeps
them apart.

Every forward goes through `ModelForward`, the module FSDP2 shards as the root, so that the
embedding and the heads are gathered around it (the fused log-prob kernel reads the LM head's
weight directly, not through the model's own forward).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from stream_rlhf.algos.losses import host_metrics
from stream_rlhf.backends.core_lending import govern
from stream_rlhf.backends.host_snapshot import HostSnapshots
from stream_rlhf.backends.model_forward import ModelForward
from stream_rlhf.backends.optimizer_config import OptimizerConfig
from stream_rlhf.backends.precision import Precision, autocast, resolve_precision
from stream_rlhf.backends.step_memory import accumulate, checkpoint_activations, micro_batches
from stream_rlhf.backends.train_engine import LossFn, Offloadable
from stream_rlhf.device_copy import to_device
from stream_rlhf.distributed import RankGroup
from stream_rlhf.experience import Experience
from stream_rlhf.models.checkpoint import decoder_layers, save_checkpoint
from stream_rlhf.models.lora import ADAPTER_FOLDER, adapters_off, has_lora, merge_lora, merged_names, save_adapter
from stream_rlhf.models.packing import shared_prompt_lens
from stream_rlhf.samples import SampleImages
from stream_rlhf.telemetry.cuda_allocator import allocator_counter
from stream_rlhf.weights.shm_store import WeightStore

HOST_FIELDS = ("sequences", "prompt_lens")
"""What a train step leaves on the host: the packing reads the tokens and lengths there (slices, shared
prompts) and moves each packed tensor once, so nothing in the step waits for the device to read them."""


class TorchTrainEngine:
    def __init__(self, model: nn.Module, group: RankGroup, optimizer: OptimizerConfig | None = None,
                 precision: Precision = "fp32", micro_batch_tokens: int | None = None):
        """`precision` bf16 (or auto on CUDA): every forward under bf16 autocast (`backends/precision.py`).
        `micro_batch_tokens`: a forward-only engine's budget per pass (`step_memory.py`); a training
        engine takes its optimizer config's, for its steps and its forwards."""
        self.group = group
        self.device = group.device
        self.precision = resolve_precision(precision, self.device)
        self.model = model.to(self.device)
        govern(self.model)  # core lending, when the launcher turned it on for this stage
        freeze_vision_tower(self.model)
        self.sharded = optimizer is not None and group.distributed
        self.lora = has_lora(self.model)  # adapters only train; exports merge them (`models/lora.py`)
        if optimizer is not None and optimizer.gradient_checkpointing:
            checkpoint_activations(self.model)
        self.forward_module = ModelForward(self.model, self.sharded)
        if self.sharded:  # over this group's ranks, on their device type (a CPU group on a GPU machine too)
            mesh = init_device_mesh(self.device.type, (group.world_size,))
            for layer in decoder_layers(self.model):
                fully_shard(layer, mesh=mesh)
            fully_shard(self.forward_module, mesh=mesh)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]  # sharded ones, if sharded
        self.max_grad_norm = optimizer.max_grad_norm if optimizer else 0.0
        self.micro_batch_tokens = optimizer.micro_batch_tokens if optimizer else micro_batch_tokens
        self.optimizer = None if optimizer is None else torch.optim.AdamW(  # fused: one kernel per step on CUDA
            self.trainable, lr=optimizer.lr, weight_decay=optimizer.weight_decay,
            fused=True if self.device.type == "cuda" else None)
        self.model.train(optimizer is not None)
        self._host_buffers: dict[tuple, Tensor] = {}  # pinned host copies of what offload moved (CUDA)
        self._snapshots = HostSnapshots()  # host copies of the state checkpoints write
        self._weight_snapshots = HostSnapshots()  # host copies of the versions a background publish writes

    # ---- forward -----------------------------------------------------------------------------

    def logprobs(self, sequences: list[Tensor], temperature: float, with_entropy: bool = False,
                 images: list[SampleImages] | None = None,
                 prompt_lens: Tensor | None = None) -> tuple[list[Tensor], list[Tensor] | None]:
        with autocast(self.device, self.precision):
            return self.forward_module(sequences, images, temperature, with_entropy, prompt_lens)

    def values(self, sequences: list[Tensor], images: list[SampleImages] | None = None,
               prompt_lens: Tensor | None = None) -> list[Tensor]:
        with autocast(self.device, self.precision):
            outputs, _ = self.forward_module(sequences, images, prompt_lens=prompt_lens)
        return list(torch.cat([v[:-1, 0] for v in outputs]).float().split([len(v) - 1 for v in outputs]))  # (L_i - 1,)

    def response_logprobs(self, part: Experience, temperature: float,
                          with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
        with autocast(self.device, self.precision):
            return self.forward_module(part.sequences, part.images, temperature, with_entropy, part.prompt_lens,
                                       responses=part.mask.shape[1])

    def response_values(self, part: Experience) -> Tensor:
        with autocast(self.device, self.precision):
            outputs, _ = self.forward_module(part.sequences, part.images, prompt_lens=part.prompt_lens,
                                             responses=part.mask.shape[1])
        return outputs[..., 0].float()  # (n, R)

    def forward_logprobs(self, sequences: list[Tensor], temperature: float,
                         images: list[SampleImages] | None = None, prompt_lens: Tensor | None = None) -> list[Tensor]:
        return self._shared(lambda seqs, ims, lens: self.logprobs(seqs, temperature, images=ims, prompt_lens=lens)[0],
                            sequences, images, prompt_lens)

    def forward_values(self, sequences: list[Tensor], images: list[SampleImages] | None = None,
                       prompt_lens: Tensor | None = None) -> list[Tensor]:
        return self._shared(self.values, sequences, images, prompt_lens)

    def forward_response_logprobs(self, exp: Experience, temperature: float, base: bool = False) -> Tensor:
        """(N, R) `response_logprobs` of a whole mini-batch, no gradient, on the CPU on every rank:
        each rank computes its share (one copy to the host), then all gather. `base`: the model's
        without its LoRA adapters (the starting checkpoint's: the reference policy's)."""
        if base:
            if not self.lora:
                raise ValueError("forward_response_logprobs(base=True): this engine's model has no LoRA adapters")
            with adapters_off(self.model):
                return self.forward_response_logprobs(exp, temperature)
        width = exp.mask.shape[1]
        mine = exp.select(torch.arange(exp.num_samples)[self.group.shard(exp.num_samples)])
        parts = [torch.zeros(0, width)]
        with torch.no_grad() if self.sharded else torch.inference_mode():
            for run in self._runs(mine.sequences, mine.images, mine.prompt_lens):
                if len(run):
                    part = mine if len(run) == mine.num_samples else mine.select(run)  # one run: no copy
                    parts.append(self.response_logprobs(part, temperature)[0].float().cpu())
                elif self.sharded:  # a sharded model's forward is a collective: take part with one token
                    self.logprobs(exp.sequences[:1], temperature,
                                  images=exp.images[:1] if exp.images is not None else None)
        return torch.cat(self.group.gather_ragged([torch.cat(parts).flatten()])).view(-1, width)

    def _shared(self, forward, sequences: list[Tensor], images: list[SampleImages] | None,
                prompt_lens: Tensor | None) -> list[Tensor]:
        """`forward` over this rank's share of `sequences` (no grad), gathered from every rank."""
        mine = self.group.shard(len(sequences))
        local_sequences = sequences[mine]
        local_images = images[mine] if images is not None else None
        local_lens = prompt_lens[mine] if prompt_lens is not None else None
        local: list[Tensor] = []
        # no inference mode on a sharded engine: FSDP2 reuses its all-gather buffers in the training
        # forwards, and an inference tensor cannot be written to outside inference mode
        with torch.no_grad() if self.sharded else torch.inference_mode():
            for run in self._runs(local_sequences, local_images, local_lens):
                if len(run):
                    picked = run.tolist()
                    local += forward([local_sequences[i] for i in picked],
                                     [local_images[i] for i in picked] if local_images is not None else None,
                                     local_lens[run] if local_lens is not None else None)
                elif self.sharded:  # a sharded model's forward is a collective: take part with one token
                    forward(sequences[:1], images[:1] if images is not None else None, None)
        return [t.float() for t in self.group.gather_ragged(local)]  # (cast on the host)

    def _runs(self, sequences: list[Tensor], images: list[SampleImages] | None,
              prompt_lens: Tensor | None) -> list[Tensor]:
        """This rank's micro-batches of these samples (`step_memory.micro_batches`, a shared prompt
        counted once: text models; one run without a budget, an empty one without samples);
        sharded, as many as the rank that needs most, empty ones at the end (each pass of a sharded
        model is a collective)."""
        runs = micro_batches(sequences, self.micro_batch_tokens, shared_prompt_lens(prompt_lens, images))
        if self.sharded and self.micro_batch_tokens is not None:
            runs += [torch.arange(0)] * (int(self.group.max([float(len(runs))])[0]) - len(runs))
        return runs

    # ---- training ----------------------------------------------------------------------------

    def train_step(self, part: Experience, loss_fn: LossFn, per_sample: dict[str, Tensor]) -> dict[str, float]:
        """One optimizer step that waits for the device once, to read its metrics (`host_metrics`);
        the step's samples go to the device from pinned memory without blocking (`to_device`).
        With `micro_batch_tokens`, this rank's samples pass in micro-batches (`step_memory.py`),
        each loss scaled by its share of the rank's tokens: the gradients add up to the one pass's.
        Sharded, every rank runs as many as the rank that needs most (the others' extra passes
        weigh nothing: FSDP2's gathers are collectives) and gradients are reduced once, at the last."""
        if self.optimizer is None:
            raise RuntimeError("train_step: this engine was built without an optimizer (forward only)")
        index = torch.arange(part.num_samples)[self.group.shard(part.num_samples)]
        mine = part.select(index)  # on the host
        runs = self._runs(mine.sequences, mine.images, mine.prompt_lens)
        scale, tokens = 1.0, 0.0
        if self.group.distributed or len(runs) > 1:  # the host-side mask: no wait for the device
            tokens = float(mine.mask.sum())
        if self.group.distributed:  # each rank's loss scaled by its share of the step's tokens
            total = self.group.sum([tokens])[0]
            scale = tokens * self.group.world_size / max(total, 1.0)
        self.optimizer.zero_grad()
        loss, metrics = None, {}
        for number, run in enumerate(runs):
            if self.sharded and len(runs) > 1:
                self.forward_module.set_requires_gradient_sync(number == len(runs) - 1)
            share = 1.0 if len(runs) == 1 else float(mine.mask[run].sum()) / max(tokens, 1.0)
            picked = run if len(run) else torch.arange(1)  # an extra pass: one sample, weighing nothing
            whole = len(picked) == mine.num_samples  # one run of every sample: no copies
            local = (mine if whole else mine.select(picked)).to(self.device, keep_on_host=HOST_FIELDS)
            local_per_sample = {name: to_device(t[index] if whole else t[index][picked], self.device)
                                for name, t in per_sample.items()}
            run_loss, run_metrics = loss_fn(local, local_per_sample)
            (run_loss * (share * scale) if share * scale != 1.0 else run_loss).backward()
            if len(run):
                loss, metrics = accumulate(loss, metrics, run_loss.detach(), run_metrics, share)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.max_grad_norm)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        read = host_metrics({**metrics, "loss": loss, "grad_norm": grad_norm})
        allocator_counter(self.device)
        grad_norm_value = read.pop("grad_norm")
        if self.group.distributed:
            read = self._token_weighted(read, tokens, total)
        return {**read, "grad_norm": grad_norm_value}

    def _token_weighted(self, metrics: dict[str, float], tokens: float, total: float) -> dict[str, float]:
        """Each metric over every rank's tokens: token-weighted means, and maxima for `*_max`."""
        names = sorted(metrics)
        means = [n for n in names if not n.endswith("_max")]
        summed = self.group.sum([metrics[n] * tokens / max(total, 1.0) for n in means])
        tops = self.group.max([metrics[n] for n in names if n.endswith("_max")])
        return {**dict(zip(means, summed)), **dict(zip([n for n in names if n.endswith("_max")], tops))}

    # ---- weights -----------------------------------------------------------------------------

    def export_weights(self, trainable_only: bool = False) -> dict[str, Tensor]:
        """Full tensors in Hugging Face names, on the CPU; a sharded engine gathers them (every
        rank must call this). Tied weights map to one tensor. LoRA adapters come merged into their
        weights (`models/lora.py`): `trainable_only` then gives the weights they change."""
        if not self.lora:
            return self._gathered(trainable_only)
        merged = merge_lora(self._gathered())
        return {name: merged[name] for name in self.trained_names()} if trainable_only else merged

    def _gathered(self, trainable_only: bool = False) -> dict[str, Tensor]:
        """The model's own state, LoRA adapters as their own entries (unmerged), full tensors on the
        CPU: gathered when sharded."""
        named = self.model.named_parameters() if trainable_only else self.model.state_dict(keep_vars=True).items()
        full: dict[int, Tensor] = {}
        out = {}
        for name, tensor in named:
            if trainable_only and not tensor.requires_grad:
                continue
            if id(tensor) not in full:
                if isinstance(tensor, DTensor):  # gathered into a padded buffer: a tensor of its own
                    full[id(tensor)] = tensor.full_tensor().detach().cpu().clone()
                else:
                    full[id(tensor)] = tensor.detach().cpu()
            out[name] = full[id(tensor)]
        return out

    def snapshot_weights(self) -> dict[str, Tensor]:
        """Sharded, the gathered copies `export_weights` makes anyway; unsharded, the live tensors
        copied into host buffers kept for the next call (pinned, without a wait per tensor, from a GPU)."""
        if self.sharded:
            return self.export_weights()
        return self._weight_snapshots.take(merge_lora(self.model.state_dict(keep_vars=True)))

    def trained_names(self) -> list[str]:
        if self.lora:
            return merged_names(self.model)
        return [name for name, p in self.model.named_parameters() if p.requires_grad]

    def parameter_counts(self) -> tuple[int, int]:
        """(trained, all) parameters (a sharded DTensor counts its whole shape)."""
        return sum(p.numel() for p in self.trainable), sum(p.numel() for p in self.model.parameters())

    def refresh(self, store: WeightStore, held: int) -> int:
        """Every rank loads the same version: the newest any rank has seen, when newer than `held`."""
        if self.sharded:
            raise NotImplementedError("refresh of a sharded (training) engine: trainers publish, they do not load")
        while True:
            newest = int(self.group.max([float(store.latest_version())])[0])
            if newest <= held:
                return held
            try:
                store.load_version(self.model, newest)
                return newest
            except FileNotFoundError:  # left the window meanwhile: agree on a newer one
                continue

    def save(self, folder: Path, tokenizer: object) -> None:
        """The weights as a Hugging Face checkpoint folder (gathered on every rank, written by the
        leader); with LoRA the merged weights, and the adapters alone in `folder/adapter` (PEFT's
        format). `snapshot_state` keeps what training resumes from."""
        own = self._gathered()
        state = merge_lora(own)
        if self.group.is_leader:
            save_checkpoint(self.model, tokenizer, folder, state_dict=state)
            if self.lora:
                save_adapter(own, folder / ADAPTER_FOLDER)

    def snapshot_state(self) -> dict | None:
        """Everything training resumes from, as a host copy training no longer changes
        (`host_snapshot.py`): the full weights, the optimizer's state (full tensors, gathered from
        every rank's shard) and the torch RNG. Every rank calls it; the leader gets it, the others None."""
        state = self._resume_state()
        return self._snapshots.take(state) if self.group.is_leader else None

    def reserve_snapshot(self) -> None:
        """Unsharded on a GPU, the pinned host buffers of the next `snapshot_state`, allocated in
        the background now (after an optimizer step: Adam's moments exist). Sharded, the state is
        gathered into fresh host tensors anyway, and on the CPU nothing is pinned: nothing to do."""
        if not self.sharded and self.device.type == "cuda" and self.group.is_leader:
            self._snapshots.reserve(self._resume_state())

    def _resume_state(self) -> dict:
        """The state `snapshot_state` copies: unsharded, the live tensors as they are (from a GPU
        they go straight into pinned memory); sharded, each full tensor gathered onto the host one
        at a time (a collective: every rank calls it)."""
        weights = self._gathered() if self.sharded else self.model.state_dict(keep_vars=True)  # adapters apart
        optimizer = None
        if self.optimizer is not None:
            options = StateDictOptions(full_state_dict=True, cpu_offload=self.sharded)
            optimizer = get_optimizer_state_dict(self.model, self.optimizer, options=options)
        return {"model": weights, "optimizer": optimizer, "rng": torch.get_rng_state()}

    def load_state(self, path: Path) -> None:
        """A saved `snapshot_state` (`torch.save`), into this engine: each rank keeps its shard of the weights and
        of the optimizer's state."""
        state = torch.load(path, map_location="cpu", weights_only=True)
        options = StateDictOptions(full_state_dict=True)
        if self.sharded:
            set_model_state_dict(self.model, state["model"], options=options)
        else:
            self.model.load_state_dict(state["model"])
        if self.optimizer is not None:
            if state["optimizer"] is None:
                raise ValueError(f"{path}: holds no optimizer state, and this engine trains")
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=options)
        torch.set_rng_state(state["rng"])

    def load(self, folder: Path) -> None:
        """The weights of a Hugging Face checkpoint folder of this model's class (what `save`
        writes), into this engine's model: each rank keeps its shard."""
        if not hasattr(type(self.model), "from_pretrained"):
            raise TypeError(f"load: {type(self.model).__name__} is not a Hugging Face model class")
        full = type(self.model).from_pretrained(str(folder), dtype=torch.float32).state_dict()
        if self.lora:  # the folder's weights are the merged ones: the adapters start again from them
            own = self._gathered()
            full = {**own, **full, **{name: torch.zeros_like(b) for name, b in own.items() if name.endswith(".lora_B")}}
        if self.sharded:
            set_model_state_dict(self.model, full, options=StateDictOptions(full_state_dict=True))
        else:
            self.model.load_state_dict(full)

    # ---- offload ----------------------------------------------------------------------------

    def offload(self, what: set[Offloadable]) -> int:
        """Move `what` to pinned host memory (CUDA); returns the bytes moved. A no-op on a CPU
        device, where that state already lives in host memory. The host buffers are kept, so a
        round trip pins memory once, and a round trip is bit-exact."""
        return self._move(what, to_host=True)

    def onload(self, what: set[Offloadable]) -> int:
        return self._move(what, to_host=False)

    def _move(self, what: set[Offloadable], to_host: bool) -> int:
        """Copies on the current CUDA stream. On a side stream (a device group's prefetch), each
        tensor brought back is recorded on the default stream, where the model computes, so the
        caching allocator never hands its block to the side stream while the model still uses it."""
        if self.device.type == "cpu":
            return 0
        if self.sharded:
            raise NotImplementedError("offload of an FSDP2-sharded engine is not built yet (offload policies)")
        moved = 0
        stream = torch.cuda.current_stream(self.device)
        compute = torch.cuda.default_stream(self.device)

        def move(key: tuple, tensor: Tensor) -> Tensor:
            nonlocal moved
            moved += tensor.numel() * tensor.element_size()
            if not to_host:
                on_device = tensor.to(self.device, non_blocking=True)
                if stream != compute:
                    on_device.record_stream(compute)
                return on_device
            host = self._host_buffers.get(key)
            if host is None or host.shape != tensor.shape or host.dtype != tensor.dtype:
                host = self._host_buffers[key] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            return host.copy_(tensor, non_blocking=True)

        for index, p in enumerate(self.model.parameters()):
            if "params" in what and (p.data.device.type == "cpu") != to_host:
                p.data = move(("param", index), p.data)
            if "grads" in what and p.grad is not None and (p.grad.device.type == "cpu") != to_host:
                p.grad = move(("grad", index), p.grad)
        if "optimizer" in what and self.optimizer is not None:
            for index, state in enumerate(self.optimizer.state.values()):
                for key, value in state.items():
                    if isinstance(value, Tensor) and value.dim() > 0 and (value.device.type == "cpu") != to_host:
                        state[key] = move(("optimizer", index, key), value)
        stream.synchronize()  # the copies are complete (and timed) when this returns
        if to_host:
            torch.cuda.empty_cache()  # what left can serve another process on this device (vLLM, a stage)
        return moved


def freeze_vision_tower(model: nn.Module) -> list[nn.Parameter]:
    """Freeze a vision-language model's vision tower (RL trains the language model only; the
    vision stage's features stay valid) and return the parameters left to train."""
    tower = getattr(getattr(model, "model", None), "visual", None)
    if tower is not None:
        tower.requires_grad_(False)
    return [p for p in model.parameters() if p.requires_grad]
