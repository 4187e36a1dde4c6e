"""The `megatron` train engine: megatron-core's GPTModel over the stage group, tp x pp x cp x dp.

    engine = MegatronTrainEngine(load_policy(path), ctx.group, cfg.actor, MegatronConfig(tp=2))
    logp = engine.forward_logprobs(sequences, temperature)   # every rank gets every sample's
    metrics = engine.train_step(part, loss_fn, per_sample)   # megatron's distributed optimizer
    weights = engine.export_weights()                        # Hugging Face names, full tensors

The same `TrainEngine` protocol as the torch backend (`backends/train_engine.py`), so the stages and
losses (`algos/`) are the same. Each data-parallel replica (tp x pp x cp ranks) takes its share of
the samples; every forward and training pass runs through megatron's pipeline schedule with one
micro-batch, the share right-padded to (B, S) under an explicit causal mask (no packing and no
shared-prompt forwards yet: the same log-probs, more compute). A vision-language model's first stage
embeds the tokens and puts the vision stage's features in at the image tokens, with Qwen2-VL's
M-RoPE (3, B, S) positions; its frozen vision tower never enters megatron (its weights are exported
as they came). Log-probs and entropies come from the fused kernel (`kernels/`) on the last stage's
hidden states and the output layer's weight, all-gathered over tp (logits are never formed). Under
context parallelism (cp > 1) each rank of a replica runs its part of every sequence (`context.py`:
megatron's load-balanced chunks, the batch right-padded to a multiple of 2 x cp) and the per-token
log-probs and values are all-gathered over cp (`kernels/cp_gather.py`), so callers see the same
(L_i - 1,) results as with cp = 1. Inside `train_step`, `logprobs` / `values` read the hidden states
of the step's own forward, so a loss function written for the torch engine works unchanged.
Gradients are averaged over dp x cp by megatron's DDP (each rank's loss scaled by its share of the
step's tokens, as in the torch engine), clipped to `max_grad_norm` and stepped by megatron's
distributed optimizer (AdamW; megatron leaves biases and norms out of weight decay). On CUDA,
`offload`/`onload` move the parameters, DDP's gradient buffers and the optimizer state to pinned
host memory and back storage by storage (`offload.py`), so megatron's views into them stay valid.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import Tensor, nn

from stream_rlhf.backends.megatron.arch_qwen2_vl import VISION_PREFIX
from stream_rlhf.backends.megatron.config import MegatronConfig, check_parallel
from stream_rlhf.backends.megatron.context import ContextSplit, padded_ids
from stream_rlhf.backends.megatron.model import architecture, build_model, causal_mask, dims, join_megatron, text_config
from stream_rlhf.backends.megatron.offload import HostCopies
from stream_rlhf.backends.megatron.optimizer import MegatronOptimizer
from stream_rlhf.backends.megatron.state import Layout, export_hf_state, load_hf_state
from stream_rlhf.backends.optimizer_config import OptimizerConfig
from stream_rlhf.backends.train_engine import LossFn, Offloadable
from stream_rlhf.broker.rank_group import RankGroup
from stream_rlhf.kernels import logprobs_from_hidden
from stream_rlhf.models.checkpoint import save_checkpoint
from stream_rlhf.models.vision_language import SampleImages, check_sample_images, mrope_positions, scatter_image_features
from stream_rlhf.stages.experience import Experience
from stream_rlhf.weights.shm_store import WeightStore, reading

from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region  # noqa: E402


class Batch(NamedTuple):
    ids: Tensor  # (B, S) long, right-padded (S a multiple of 2 x cp under cp > 1)
    positions: Tensor  # (B, S), or (3, B, S) M-RoPE positions
    mask: Tensor  # (1, 1, S, S) bool, True = masked out
    features: Tensor | None  # (N, H) image features of the image tokens, row-major; None for text


class MegatronTrainEngine:
    def __init__(self, model: nn.Module, group: RankGroup, optimizer: OptimizerConfig | None = None,
                 parallel: MegatronConfig | None = None, seed: int = 0):
        """`model`: the Hugging Face policy or critic (a token classifier with a `score` head) whose
        config and weights the megatron model takes; it is kept on the meta device for `save`."""
        critic = hasattr(model, "score")
        self.vision_config = model.config if hasattr(model.config, "vision_config") else None
        if critic and self.vision_config is not None:
            raise ValueError("megatron backend: vision-language critics are not mapped yet")
        parallel = parallel or MegatronConfig()
        if parallel.recompute and group.device.type != "cuda":
            raise ValueError("megatron.recompute=true: needs CUDA (megatron's recompute saves and restores CUDA RNG "
                             "states); on the CPU leave it false")
        text = text_config(model.config)
        check_parallel(parallel, group.world_size, text.num_attention_heads, text.num_key_value_heads,
                       text.num_hidden_layers, "megatron")
        self.group = group
        self.device = group.device
        self.parallel = join_megatron(group, parallel, seed)
        self.split = ContextSplit(parallel.cp, self.parallel.cp_rank)
        hf_state = model.state_dict()
        self.frozen = {k: v.detach().clone() for k, v in hf_state.items() if k.startswith(VISION_PREFIX)}
        self.layout = Layout(architecture(model.config), dims(model.config, self.parallel.config.tp),
                             text_config(model.config).num_hidden_layers,
                             bool(getattr(model.config, "tie_word_embeddings", False)) and not critic, critic,
                             self.parallel, {k: tuple(v.shape) for k, v in hf_state.items()},
                             {k: v.dtype for k, v in hf_state.items()})
        self.model = build_model(model.config, self.parallel, critic)
        load_hf_state(self.model, hf_state, self.layout)
        self.model.to(self.device)
        self.hf_model = model.to("meta")
        del hf_state
        self.optimizer = MegatronOptimizer(self.model, optimizer) if optimizer is not None else None
        self.model.train(optimizer is not None)
        self._step_outputs: tuple[list[Tensor], Tensor] | None = None  # inside train_step: (sequences, output)
        self._host = HostCopies()  # what offload moved to host memory (CUDA)

    # ---- forward -----------------------------------------------------------------------------

    def logprobs(self, sequences: list[Tensor], temperature: float, with_entropy: bool = False,
                 images: list[SampleImages] | None = None,
                 prompt_lens: Tensor | None = None) -> tuple[list[Tensor], list[Tensor] | None]:
        return self._logprobs_of(self._output_for(sequences, images), sequences, temperature, with_entropy)

    def values(self, sequences: list[Tensor], images: list[SampleImages] | None = None,
               prompt_lens: Tensor | None = None) -> list[Tensor]:
        out = self.split.gather(self._output_for(sequences, images))  # (B, S)
        return [out[i, : len(seq) - 1] for i, seq in enumerate(sequences)]

    def forward_logprobs(self, sequences: list[Tensor], temperature: float,
                         images: list[SampleImages] | None = None, prompt_lens: Tensor | None = None) -> list[Tensor]:
        return self._shared(sequences, images, lambda out, seqs: self._logprobs_of(out, seqs, temperature, False)[0])

    def forward_values(self, sequences: list[Tensor], images: list[SampleImages] | None = None,
                       prompt_lens: Tensor | None = None) -> list[Tensor]:
        def values_of(out: Tensor, seqs: list[Tensor]) -> list[Tensor]:
            out = self.split.gather(out)  # (B, S)
            return [out[i, : len(s) - 1] for i, s in enumerate(seqs)]

        return self._shared(sequences, images, values_of)

    def _output_for(self, sequences: list[Tensor], images: list[SampleImages] | None) -> Tensor:
        """The last stage's output for `sequences`: the step's own forward inside `train_step`;
        outside it (one pipeline stage only) a forward of its own."""
        if self._step_outputs is not None:
            if self._step_outputs[0] is not sequences:
                raise ValueError("megatron train_step: the loss must ask for the log-probs of its own part's sequences")
            return self._step_outputs[1]
        if self.parallel.config.pp > 1:
            raise RuntimeError("megatron: with pp > 1 a forward runs through forward_* or train_step only")
        return self._call(self.model, self._inputs(sequences, images))

    def _inputs(self, sequences: list[Tensor], images: list[SampleImages] | None) -> Batch:
        """(B, S) right-padded ids, (B, S) positions ((3, B, S) M-RoPE ones with images), (1, 1, S, S)
        causal mask, and the (N, H) image features of the batch's image tokens in row-major order."""
        width = self.split.width(max(len(s) for s in sequences))
        ids = padded_ids(sequences, width)
        if images is None:
            positions = torch.arange(width)[None].expand(len(sequences), width)
            return Batch(ids.to(self.device), positions.to(self.device), causal_mask(width, self.device), None)
        if self.vision_config is None:
            raise ValueError("megatron backend: images given to a text model")
        positions = torch.zeros(3, len(sequences), width, dtype=torch.long)  # (3, B, S)
        for i, (seq, sample) in enumerate(zip(sequences, images, strict=True)):
            check_sample_images(i, seq, sample, self.vision_config)
            positions[:, i, : len(seq)] = mrope_positions(seq.cpu(), sample.grid_thw, self.vision_config)
        features = torch.cat([sample.features for sample in images]).to(self.device)  # (N, H)
        return Batch(ids.to(self.device), positions.to(self.device), causal_mask(width, self.device), features)

    def _call(self, model: nn.Module, batch: Batch) -> Tensor:
        """`model` (the megatron model or its DDP wrapper) on this cp rank's part of `batch`; with
        image features the first stage embeds the whole sequence itself, puts the features in at the
        image tokens and passes on its part. The positions stay whole (megatron cuts the rotary
        embedding for this cp rank); the mask keeps the rows of this rank's positions."""
        decoder_input = None
        if batch.features is not None and self.parallel.first_stage:
            embedded = self.model.embedding(input_ids=batch.ids, position_ids=None).transpose(0, 1)  # (B, S, H)
            embedded = scatter_image_features(embedded, batch.ids, batch.features, self.vision_config.image_token_id)
            decoder_input = self.split.take(embedded.transpose(0, 1), 0).contiguous()  # (S_local, B, H)
        return model(self.split.take(batch.ids, 1), batch.positions, self.split.take(batch.mask, 2),
                     decoder_input=decoder_input)

    def _logprobs_of(self, hidden: Tensor, sequences: list[Tensor], temperature: float,
                     with_entropy: bool) -> tuple[list[Tensor], list[Tensor] | None]:
        """Fused log-probs of `sequences` from the last stage's (B, S, H) hidden states (this cp
        rank's (B, S_local, H) under cp > 1)."""
        if self.split.cp > 1:
            return self._cp_logprobs_of(hidden, sequences, temperature, with_entropy)
        rows = torch.cat([torch.full((len(s) - 1,), i) for i, s in enumerate(sequences)]).to(self.device)
        cols = torch.cat([torch.arange(len(s) - 1) for s in sequences]).to(self.device)
        labels = torch.cat([s[1:] for s in sequences]).to(device=self.device, dtype=torch.long)
        logp, entropy = logprobs_from_hidden(hidden[rows, cols], self._head_weight(), labels, temperature, with_entropy)
        lengths = [len(s) - 1 for s in sequences]
        return list(logp.split(lengths)), list(entropy.split(lengths)) if with_entropy else None

    def _cp_logprobs_of(self, hidden: Tensor, sequences: list[Tensor], temperature: float,
                        with_entropy: bool) -> tuple[list[Tensor], list[Tensor] | None]:
        """`_logprobs_of` under cp: every local position's log-prob (and entropy), all-gathered over
        cp as (B, S_local, 1 or 2) floats per rank."""
        batch, local, size = hidden.shape
        labels = self.split.labels(padded_ids(sequences, local * self.split.cp).to(self.device))  # (B, S_local)
        logp, entropy = logprobs_from_hidden(hidden.reshape(-1, size), self._head_weight(), labels.reshape(-1),
                                             temperature, with_entropy)
        per_token = torch.stack([logp, entropy] if with_entropy else [logp], -1).view(batch, local, -1)
        full = self.split.gather(per_token)  # (B, S, 1 or 2)
        logps = [full[i, : len(s) - 1, 0] for i, s in enumerate(sequences)]
        return logps, [full[i, : len(s) - 1, 1] for i, s in enumerate(sequences)] if with_entropy else None

    def _head_weight(self) -> Tensor:
        """(V, H): the output layer's weight, all-gathered over tp (backward: this rank's rows)."""
        local = self.model.shared_embedding_or_output_weight() if self.layout.tied else self.model.output_layer.weight
        full = gather_from_tensor_model_parallel_region(local.t()).t() if self.parallel.config.tp > 1 else local
        return full[: self.layout.dims.vocab]

    def _shared(self, sequences: list[Tensor], images: list[SampleImages] | None, result) -> list[Tensor]:
        """`result(output, share)` over this replica's share of `sequences`, no gradient; every rank
        gets every sample's (L_i - 1,) floats, on the CPU."""
        mine = self._share(len(sequences))
        local = sequences[mine]
        lengths = [len(s) - 1 for s in sequences]
        offsets = [0] + torch.tensor(lengths).cumsum(0).tolist()
        flat = torch.zeros(offsets[-1], dtype=torch.float32)
        if local:
            with torch.no_grad():
                outputs = self._schedule(local, images[mine] if images is not None else None,
                                         lambda out: (out.sum() * 0, {"out": result(out, local)}), True)
            if outputs and self.parallel.tp_rank == 0 and self.parallel.cp_rank == 0:
                flat[offsets[mine.start]: offsets[mine.stop]] = torch.cat(outputs[0]["out"]).float().cpu()
        if self.group.distributed:
            dist.all_reduce(flat)  # one writer per sample: the last stage's tp and cp rank 0 of its replica
        return list(flat.split(lengths))

    def _share(self, n: int) -> slice:
        """This data-parallel replica's contiguous share of `n` samples."""
        base, extra = divmod(n, self.parallel.dp)
        rank = self.parallel.dp_rank
        start = rank * base + min(rank, extra)
        return slice(start, start + base + (rank < extra))

    def _schedule(self, sequences: list[Tensor], images: list[SampleImages] | None, loss,
                  forward_only: bool) -> list[dict]:
        """One micro-batch through megatron's pipeline schedule; `loss(output)` runs on the last
        stage and returns (loss, extras); the last stage gets the list of extras."""
        batch = self._inputs(sequences, images)

        def forward_step(_iterator, model):
            return self._call(model, batch), loss

        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([None]),
            model=[self.optimizer.ddp if self.optimizer is not None else self.model], num_microbatches=1,
            seq_length=batch.ids.shape[1], micro_batch_size=batch.ids.shape[0], forward_only=forward_only)

    # ---- training ----------------------------------------------------------------------------

    def train_step(self, part: Experience, loss_fn: LossFn, per_sample: dict[str, Tensor]) -> dict[str, float]:
        if self.optimizer is None:
            raise RuntimeError("train_step: this engine was built without an optimizer (forward only)")
        mine = self._share(part.num_samples)
        index = torch.arange(part.num_samples)[mine]
        empty = len(index) == 0  # fewer samples than replicas: take part in the collectives with a zero loss
        local = part.select(index if not empty else torch.arange(1)).to(self.device)
        local_per_sample = {name: t[index if not empty else torch.arange(1)].to(self.device)
                            for name, t in per_sample.items()}
        tokens = 0.0 if empty else float(local.mask.sum().item())
        total = self.group.sum([tokens])[0] / self.parallel.config.model_parallel
        # DDP averages the gradients over dp x cp; megatron's schedule multiplies the loss by cp (each
        # cp rank's backward carries its own positions' part of the replica's loss: `cp_gather`)
        scale = tokens * self.parallel.dp / max(total, 1.0)

        def loss(output: Tensor):
            self._step_outputs = (local.sequences, output)
            try:
                value, metrics = loss_fn(local, local_per_sample)
            finally:
                self._step_outputs = None
            return value * scale, {"metrics": {**metrics, "loss": value.item()}}

        self.optimizer.zero_grad()
        outputs = self._schedule(local.sequences, local.images, loss, False)
        grad_norm = self.optimizer.step()
        metrics = outputs[0]["metrics"] if outputs else {}
        return {**self._reduced(metrics, tokens, total), "grad_norm": grad_norm}

    def _reduced(self, metrics: dict[str, float], tokens: float, total: float) -> dict[str, float]:
        """Token-weighted means (maxima for `*_max`) over the replicas, on every rank. The last
        stage's tp and cp rank 0 of each replica contributes; the names come from the lowest-ranked of
        those, broadcast as text."""
        if not self.group.distributed:
            return metrics
        writer = self.parallel.tp_rank == 0 and self.parallel.cp_rank == 0 and self.parallel.last_stage
        first_writer = torch.tensor([dist.get_rank() if writer else dist.get_world_size()])
        dist.all_reduce(first_writer, op=dist.ReduceOp.MIN)
        names = _broadcast_names(sorted(metrics), int(first_writer.item()))
        means = [n for n in names if not n.endswith("_max")]
        tops = [n for n in names if n.endswith("_max")]
        summed = torch.tensor([metrics[n] * tokens / max(total, 1.0) if writer else 0.0 for n in means], dtype=torch.float64)
        dist.all_reduce(summed)
        top = torch.tensor([metrics[n] if writer else -float("inf") for n in tops], dtype=torch.float64)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        return {**dict(zip(means, summed.tolist())), **dict(zip(tops, top.tolist()))}

    # ---- weights -----------------------------------------------------------------------------

    def export_weights(self, trainable_only: bool = False) -> dict[str, Tensor]:
        """Full tensors in Hugging Face names, on the CPU, on every rank (every rank must call it)."""
        trained = export_hf_state(self.model, self.layout)
        return trained if trainable_only else {**trained, **self.frozen}

    def trained_names(self) -> list[str]:
        return [name for name in self.layout.hf_shapes
                if name not in self.frozen and not (self.layout.tied and name == self.layout.arch.lm_head)]

    def refresh(self, store: WeightStore, held: int) -> int:
        """Every rank loads the same version: the newest any rank has seen, when newer than `held`."""
        while True:
            newest = int(self.group.max([float(store.latest_version())])[0])
            if newest <= held:
                return held
            try:
                with reading(store.path(newest)):
                    weights = load_file(str(store.path(newest)))
            except FileNotFoundError:  # left the window meanwhile: agree on a newer one
                continue
            load_hf_state(self.model, self._untied(weights), self.layout)
            return newest

    def save(self, folder: Path, tokenizer: object) -> None:
        state = self.export_weights()
        if self.group.is_leader:
            save_checkpoint(self.hf_model, tokenizer, folder, state_dict=state)

    def load(self, folder: Path) -> None:
        state = {}
        for file in sorted(Path(folder).glob("*.safetensors")):
            state.update(load_file(str(file)))
        load_hf_state(self.model, self._untied(state), self.layout)

    def _untied(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """A stored state dict keeps a tied LM head once, as the embedding: name it again."""
        if self.layout.tied and self.layout.arch.lm_head not in state:
            state[self.layout.arch.lm_head] = state[self.layout.arch.embed]
        return state

    def save_state(self, path: Path) -> None:
        """The full weights (HF names), every rank's optimizer shard and the RNG in one file;
        the leader writes."""
        weights = self.export_weights()
        shards = self.optimizer.gather_state(self.group) if self.optimizer is not None else None
        if self.group.is_leader:
            torch.save({"model": weights, "optimizer": shards, "rng": torch.get_rng_state(),
                        "layout": self._layout_key()}, path)

    def load_state(self, path: Path) -> None:
        state = torch.load(path, map_location="cpu", weights_only=True)
        load_hf_state(self.model, state["model"], self.layout)
        if self.optimizer is not None:
            if state["optimizer"] is None:
                raise ValueError(f"{path}: holds no optimizer state, and this engine trains")
            if state["layout"] != self._layout_key():
                raise ValueError(f"{path}: optimizer state of a megatron layout (ranks, tp, pp, cp) = "
                                 f"{state['layout']}, this engine is {self._layout_key()}")
            self.optimizer.load_shard(state["optimizer"][self.group.rank])
        torch.set_rng_state(state["rng"])

    def _layout_key(self) -> list[int]:
        return [self.group.world_size, self.parallel.config.tp, self.parallel.config.pp, self.parallel.config.cp]

    # ---- offload -----------------------------------------------------------------------------

    def offload(self, what: set[Offloadable]) -> int:
        """`what` to pinned host memory, storage by storage (`offload.py`: megatron's buffers keep
        their views); the bytes moved. "grads" are DDP's main_grad buffers (and whatever the
        optimizer steps on). A no-op on a CPU device, where that state already lives in host memory."""
        if self.device.type == "cpu":
            return 0
        moved = sum(self._host.offload(kind, self._state_of(kind)) for kind in sorted(what))
        torch.cuda.empty_cache()  # what left can serve another process on this device (vLLM, a stage)
        return moved

    def onload(self, what: set[Offloadable]) -> int:
        if self.device.type == "cpu":
            return 0
        moved = sum(self._host.onload(kind) for kind in sorted(what))
        torch.cuda.synchronize(self.device)  # the copies are complete (and timed) when this returns
        return moved

    def _state_of(self, kind: Offloadable) -> list[Tensor]:
        """This rank's device tensors of `kind` (views share storages: `HostCopies` moves each once)."""
        params = list(self.model.parameters())
        if kind == "params":
            found = params
        elif kind == "grads":
            found = [g for p in params for g in (getattr(p, "main_grad", None), p.grad) if g is not None]
            found += self.optimizer.main_grads() if self.optimizer is not None else []
        else:
            found = self.optimizer.state_tensors() if self.optimizer is not None else []
        return [t for t in found if t.device.type != "cpu"]


def _broadcast_names(names: list[str], source: int) -> list[str]:
    """`names` of global rank `source`, on every rank (UTF-8 over the default group)."""
    frame = "\n".join(names).encode() if dist.get_rank() == source else b""
    size = torch.tensor([len(frame)], dtype=torch.int64)
    dist.broadcast(size, src=source)
    data = torch.frombuffer(bytearray(frame), dtype=torch.uint8) if frame else torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, src=source)
    text = data.numpy().tobytes().decode()
    return text.split("\n") if text else []
