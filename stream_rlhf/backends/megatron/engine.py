"""The `megatron` train engine: megatron-core's GPTModel over the stage group, tp x pp x cp x dp.

    engine = MegatronTrainEngine(load_policy(path), ctx.group, cfg.actor, MegatronConfig(tp=2))
    logp = engine.forward_logprobs(sequences, temperature)   # every rank gets every sample's
    metrics = engine.train_step(part, loss_fn, per_sample)   # megatron's distributed optimizer
    weights = engine.export_weights()                        # Hugging Face names, full tensors

The same `TrainEngine` protocol as the torch backend (`backends/train_engine.py`), so the stages and
losses (`algos/`) are the same. Each data-parallel replica (tp x pp x cp ranks) takes its share of
the samples; every forward and training pass runs through megatron's pipeline schedule, the share
as one micro-batch or, with `micro_batch_tokens`, in micro-batches of whole samples
(`step_memory.micro_batches`; 1F1B under pp > 1, every micro-batch padded to one shape), each
packed padding-free as the torch engine packs it (`batch.py`: several sequences per row, positions
restarting per sequence, the layout's block-diagonal causal mask as megatron's explicit mask; with
`prompt_lens` a prompt's samples share its forward). A
vision-language model's first stage embeds the rows and puts the vision stage's features in at the
image tokens, with Qwen2-VL's M-RoPE (3, R, C) positions; its frozen vision tower never enters
megatron (its weights are exported as they came); its critic (`VisionLanguageCritic`) is the same
language model with a value head. Log-probs and entropies come from the fused kernel (`kernels/`)
on the last stage's hidden states and the output layer's weight, all-gathered over tp (logits are
never formed). Under context parallelism (cp > 1) each rank of a replica runs its part of every
row (`context.py`: megatron's load-balanced chunks, the rows right-padded to a multiple of 2 x cp)
and only per-token floats cross the cp ranks, so callers see the same (L_i - 1,) results as with
cp = 1. Inside `train_step`, `logprobs` / `values` read the hidden states of the step's own forward
(packed by the part's `prompt_lens`, as the stages' losses ask), so a loss function written for the
torch engine works unchanged.
Gradients are averaged over dp x cp by megatron's DDP after the last micro-batch (each
micro-batch's loss scaled by its share of the step's tokens, as in the torch engine), clipped to
`max_grad_norm` and stepped by megatron's distributed optimizer (AdamW; megatron leaves biases and
norms out of weight decay); the step's metrics are read from the device once (`step_metrics.py`
combines the replicas'). With `precision` bf16 (`auto` on CUDA) the schedule, forward and backward,
runs under bf16 autocast, the torch engine's mixed precision: weights, gradients and optimizer
state fp32, log-probs from fp32 hidden states; megatron's residual stream follows its layers'
bf16 outputs, so the pipeline passes bf16 activations (`model.py`). On CUDA, `offload`/`onload`
move the parameters, DDP's gradient buffers and the optimizer state to pinned host memory and back
storage by storage (`offload.py`), so megatron's views into them stay valid.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region  # noqa: E402
from safetensors.torch import load_file
from torch import Tensor, nn

from stream_rlhf.algos.losses import host_metrics
from stream_rlhf.backends.host_snapshot import HostSnapshots
from stream_rlhf.backends.megatron.arch_qwen2_vl import VISION_PREFIX
from stream_rlhf.backends.megatron.batch import (
    Batch,
    Run,
    common_shape,
    flat_values,
    packed_batch,
    run_of,
    token_logprobs,
    token_scores,
    token_values,
)
from stream_rlhf.backends.megatron.config import MegatronConfig, check_parallel
from stream_rlhf.backends.megatron.context import ContextSplit
from stream_rlhf.backends.megatron.model import architecture, build_model, dims, join_megatron, text_config
from stream_rlhf.backends.megatron.offload import HostCopies
from stream_rlhf.backends.megatron.optimizer import MegatronOptimizer
from stream_rlhf.backends.megatron.state import Layout, export_hf_state, load_hf_state
from stream_rlhf.backends.megatron.step_metrics import replica_metrics
from stream_rlhf.backends.optimizer_config import OptimizerConfig
from stream_rlhf.backends.precision import Precision, autocast, resolve_precision
from stream_rlhf.backends.step_memory import accumulate, micro_batches
from stream_rlhf.backends.train_engine import LossFn, Offloadable
from stream_rlhf.distributed import RankGroup
from stream_rlhf.experience import Experience
from stream_rlhf.models.checkpoint import save_checkpoint
from stream_rlhf.models.packing import shared_prompt_lens
from stream_rlhf.models.response_outputs import padded_responses
from stream_rlhf.models.vision_language import scatter_image_features
from stream_rlhf.samples import SampleImages, response_slices
from stream_rlhf.weights.shm_store import WeightStore


class MegatronTrainEngine:
    def __init__(self, model: nn.Module, group: RankGroup, optimizer: OptimizerConfig | None = None,
                 parallel: MegatronConfig | None = None, seed: int = 0, micro_batch_tokens: int | None = None,
                 precision: Precision = "fp32"):
        """`model`: the Hugging Face policy or critic (a token classifier, or a VLM's
        `VisionLanguageCritic`, with a `score` head) whose config and weights the megatron model
        takes; it is kept on the meta device for `save`. `micro_batch_tokens`: a forward-only
        engine's budget per micro-batch (a training engine's is its `optimizer`'s). `precision`
        bf16 (or auto on CUDA): forwards and backwards under bf16 autocast, weights, gradients and
        optimizer state fp32 (`backends/precision.py`)."""
        critic = hasattr(model, "score")
        self.vision_config = model.config if hasattr(model.config, "vision_config") else None
        parallel = parallel or MegatronConfig()
        text = text_config(model.config)
        check_parallel(parallel, group.world_size, text.num_attention_heads, text.num_key_value_heads,
                       text.num_hidden_layers, "megatron")
        self.group = group
        self.device = group.device
        self.parallel = join_megatron(group, parallel, seed)
        self.split = ContextSplit(parallel.cp, self.parallel.cp_rank)
        self.precision = resolve_precision(precision, self.device)
        hf_state = model.state_dict()
        self.frozen = {k: v.detach().clone() for k, v in hf_state.items() if k.startswith(VISION_PREFIX)}
        self.layout = Layout(architecture(model.config, critic), dims(model.config, self.parallel.config.tp),
                             text_config(model.config).num_hidden_layers,
                             bool(getattr(model.config, "tie_word_embeddings", False)) and not critic, critic,
                             self.parallel, {k: tuple(v.shape) for k, v in hf_state.items()},
                             {k: v.dtype for k, v in hf_state.items()})
        self.model = build_model(model.config, self.parallel, critic, bf16=self.precision == "bf16")
        load_hf_state(self.model, hf_state, self.layout)
        self.model.to(self.device)
        self.hf_model = model.to("meta")
        del hf_state
        self.optimizer = MegatronOptimizer(self.model, optimizer) if optimizer is not None else None
        self.micro_batch_tokens = optimizer.micro_batch_tokens if optimizer is not None else micro_batch_tokens
        self.model.train(optimizer is not None)
        # in train_step: (sequences, batch, output)
        self._step_outputs: tuple[list[Tensor], Batch, Tensor] | None = None
        self._host = HostCopies()  # what offload moved to host memory (CUDA)
        self._snapshots = HostSnapshots()  # host copies of the state checkpoints write
        self._weight_snapshots = HostSnapshots()  # host copies of the versions a background publish writes

    # ---- forward -----------------------------------------------------------------------------

    def logprobs(self, sequences: list[Tensor], temperature: float, with_entropy: bool = False,
                 images: list[SampleImages] | None = None,
                 prompt_lens: Tensor | None = None) -> tuple[list[Tensor], list[Tensor] | None]:
        batch, out = self._output_for(sequences, images, prompt_lens)
        return token_logprobs(out, self._head_weight(), batch, sequences, temperature, with_entropy, self.split)

    def values(self, sequences: list[Tensor], images: list[SampleImages] | None = None,
               prompt_lens: Tensor | None = None) -> list[Tensor]:
        batch, out = self._output_for(sequences, images, prompt_lens)
        return token_values(out, batch, self.split)

    def response_logprobs(self, part: Experience, temperature: float,
                          with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
        batch, out = self._output_for(part.sequences, part.images, part.prompt_lens)
        scored = token_scores(out, self._head_weight(), batch, part.sequences, temperature, with_entropy, self.split)
        scored = _at_responses(scored, part)
        return scored[..., 0], scored[..., 1] if with_entropy else None  # (n, R) each

    def response_values(self, part: Experience) -> Tensor:
        batch, out = self._output_for(part.sequences, part.images, part.prompt_lens)
        values = flat_values(out, batch, self.split)
        return _at_responses(values, part)

    def forward_logprobs(self, sequences: list[Tensor], temperature: float,
                         images: list[SampleImages] | None = None, prompt_lens: Tensor | None = None) -> list[Tensor]:
        def logprobs_of(out: Tensor, batch: Batch, seqs: list[Tensor]) -> list[Tensor]:
            return token_logprobs(out, self._head_weight(), batch, seqs, temperature, False, self.split)[0]

        return self._shared(sequences, images, prompt_lens, logprobs_of)

    def forward_values(self, sequences: list[Tensor], images: list[SampleImages] | None = None,
                       prompt_lens: Tensor | None = None) -> list[Tensor]:
        return self._shared(sequences, images, prompt_lens, lambda out, batch, _: token_values(out, batch, self.split))

    def forward_response_logprobs(self, exp: Experience, temperature: float, base: bool = False) -> Tensor:
        if base:
            raise ValueError("forward_response_logprobs(base=True): the megatron engine holds no LoRA adapters")
        logp = self.forward_logprobs(exp.sequences, temperature, images=exp.images, prompt_lens=exp.prompt_lens)
        return exp.padded(response_slices(logp, exp.prompt_lens))

    def _output_for(self, sequences: list[Tensor], images: list[SampleImages] | None,
                    prompt_lens: Tensor | None) -> tuple[Batch, Tensor]:
        """The batch of `sequences` and the last stage's output for it: inside `train_step` the
        step's own (packed as its part's `prompt_lens` say, whatever the loss passes: the same
        results); outside it (one pipeline stage only) a forward of its own."""
        if self._step_outputs is not None:
            if self._step_outputs[0] is not sequences:
                raise ValueError("megatron train_step: the loss must ask for the log-probs of its own part's sequences")
            return self._step_outputs[1:]
        if self.parallel.config.pp > 1:
            raise RuntimeError("megatron: with pp > 1 a forward runs through forward_* or train_step only")
        batch = self._batch(sequences, images, prompt_lens)
        with autocast(self.device, self.precision):
            return batch, self._call(self.model, batch)

    def _batch(self, sequences: list[Tensor], images: list[SampleImages] | None, prompt_lens: Tensor | None) -> Batch:
        return packed_batch(run_of(sequences, images, prompt_lens, self.vision_config), self.split,
                            self.vision_config, self.device)

    def _runs(self, sequences: list[Tensor], images: list[SampleImages] | None,
              prompt_lens: Tensor | None) -> tuple[list[Tensor], list[Run]]:
        """The micro-batches of these samples (`step_memory.micro_batches` at `micro_batch_tokens`, a
        shared prompt counted once: text models; one without a budget): each one's sample indices
        and packing."""
        runs = micro_batches(sequences, self.micro_batch_tokens, shared_prompt_lens(prompt_lens, images))
        if len(runs) == 1:
            return runs, [run_of(sequences, images, prompt_lens, self.vision_config)]
        return runs, [run_of([sequences[i] for i in run.tolist()],
                             [images[i] for i in run.tolist()] if images is not None else None,
                             prompt_lens[run] if prompt_lens is not None else None, self.vision_config)
                      for run in runs]

    def _call(self, model: nn.Module, batch: Batch) -> Tensor:
        """`model` (the megatron model or its DDP wrapper) on this cp rank's part of `batch`; with
        image features the first stage embeds the whole rows itself, puts the features in at the
        image tokens and passes on its part. The positions stay whole (megatron cuts the rotary
        embedding for this cp rank); the mask holds the rows of this rank's positions already."""
        decoder_input = None
        if batch.features is not None and self.parallel.first_stage:
            embedded = self.model.embedding(input_ids=batch.ids, position_ids=None).transpose(0, 1)  # (R, C, H)
            embedded = scatter_image_features(embedded, batch.ids, batch.features, self.vision_config.image_token_id)
            decoder_input = self.split.take(embedded.transpose(0, 1), 0).contiguous()  # (C_local, R, H)
        return model(self.split.take(batch.ids, 1), batch.positions, batch.mask,
                     decoder_input=decoder_input)

    def _head_weight(self) -> Tensor:
        """(V, H): the output layer's weight, all-gathered over tp (backward: this rank's rows)."""
        local = self.model.shared_embedding_or_output_weight() if self.layout.tied else self.model.output_layer.weight
        full = gather_from_tensor_model_parallel_region(local.t()).t() if self.parallel.config.tp > 1 else local
        return full[: self.layout.dims.vocab]

    def _shared(self, sequences: list[Tensor], images: list[SampleImages] | None, prompt_lens: Tensor | None,
                result) -> list[Tensor]:
        """`result(output, batch, share)` over this replica's share of `sequences`, no gradient;
        every rank gets every sample's (L_i - 1,) floats, on the CPU."""
        mine = self._share(len(sequences))
        local = sequences[mine]
        lengths = [len(s) - 1 for s in sequences]
        offsets = [0] + torch.tensor(lengths).cumsum(0).tolist()
        flat = torch.zeros(offsets[-1], dtype=torch.float32)
        if local:
            _, runs = self._runs(local, images[mine] if images is not None else None,
                                 prompt_lens[mine] if prompt_lens is not None else None)

            def loss_of(number: int, batch: Batch):
                return lambda out: (out.sum() * 0, {"out": result(out, batch, runs[number].sequences)})

            with torch.no_grad():
                outputs = self._schedule(runs, loss_of, True)
            if outputs and self.parallel.tp_rank == 0 and self.parallel.cp_rank == 0:
                flat[offsets[mine.start]: offsets[mine.stop]] = torch.cat(
                    [t for output in outputs for t in output["out"]]).float().cpu()
        if self.group.distributed:
            dist.all_reduce(flat)  # one writer per sample: the last stage's tp and cp rank 0 of its replica
        return list(flat.split(lengths))

    def _share(self, n: int) -> slice:
        """This data-parallel replica's contiguous share of `n` samples."""
        base, extra = divmod(n, self.parallel.dp)
        rank = self.parallel.dp_rank
        start = rank * base + min(rank, extra)
        return slice(start, start + base + (rank < extra))

    def _schedule(self, runs: list[Run], loss_of, forward_only: bool) -> list[dict]:
        """`runs` as the micro-batches of megatron's pipeline schedule (1F1B under pp > 1, every
        one padded to their common shape), each put on the device when its forward starts;
        `loss_of(number, batch)(output)` runs on the last stage and returns (loss, extras); the last
        stage gets the list of extras, in order. megatron's schedule multiplies each loss by cp and
        divides it by the number of micro-batches; DDP reduces the gradients after the last."""
        shape = common_shape(runs, self.split) if self.parallel.config.pp > 1 else None

        def forward_step(numbers, model):
            number = next(numbers)
            batch = packed_batch(runs[number], self.split, self.vision_config, self.device, shape)
            return self._call(model, batch), loss_of(number, batch)

        rows, width = shape or (0, 0)  # (sizes of the activations passed between pipeline stages)
        with autocast(self.device, self.precision):  # the backward too: a recompute runs as the forward did
            return get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(range(len(runs))),
                model=[self.optimizer.ddp if self.optimizer is not None else self.model], num_microbatches=len(runs),
                seq_length=width, micro_batch_size=rows, forward_only=forward_only)

    # ---- training ----------------------------------------------------------------------------

    def train_step(self, part: Experience, loss_fn: LossFn, per_sample: dict[str, Tensor]) -> dict[str, float]:
        if self.optimizer is None:
            raise RuntimeError("train_step: this engine was built without an optimizer (forward only)")
        mine = self._share(part.num_samples)
        index = torch.arange(part.num_samples)[mine]
        empty = len(index) == 0  # fewer samples than replicas: take part in the collectives with a zero loss
        index = index if not empty else torch.arange(1)
        host = part.select(index)
        tokens = 0.0 if empty else float(host.mask.sum())  # read before the move: no wait for the device
        total = self.group.sum([tokens])[0] / self.parallel.config.model_parallel
        # DDP averages the gradients over dp x cp; megatron's schedule multiplies the loss by cp (each
        # cp rank's backward carries its own positions' part of the replica's loss: `cp_gather`) and
        # divides it by the micro-batches, each of which weighs its share of this replica's tokens
        scale = tokens * self.parallel.dp / max(total, 1.0)
        indices, runs = self._runs(host.sequences, host.images, host.prompt_lens)
        shares = [1.0] if len(runs) == 1 else [float(host.mask[run].sum()) / max(tokens, 1.0) for run in indices]

        def loss_of(number: int, batch: Batch):
            def loss(output: Tensor):  # on the last pipeline stage
                run = indices[number]
                local = (host if len(runs) == 1 else host.select(run)).to(self.device)
                local_per_sample = {name: t[index][run].to(self.device) for name, t in per_sample.items()}
                self._step_outputs = (local.sequences, batch, output)
                try:
                    value, metrics = loss_fn(local, local_per_sample)
                finally:
                    self._step_outputs = None
                weight = scale * shares[number] * len(runs)
                detached = {name: metric.detach() for name, metric in metrics.items()}
                return value * weight, {"loss": value.detach(), "metrics": detached}
            return loss

        self.optimizer.zero_grad()
        outputs = self._schedule(runs, loss_of, False)
        grad_norm = self.optimizer.step()
        loss, metrics = None, {}
        for output, share in zip(outputs, shares):  # on the device: read once
            loss, metrics = accumulate(loss, metrics, output["loss"], output["metrics"], share)
        metrics = host_metrics({**metrics, "loss": loss}) if outputs else {}
        if self.group.distributed:
            writer = self.parallel.tp_rank == 0 and self.parallel.cp_rank == 0 and self.parallel.last_stage
            metrics = replica_metrics(metrics, writer, tokens, total)
        return {**metrics, "grad_norm": grad_norm}

    # ---- weights -----------------------------------------------------------------------------

    def export_weights(self, trainable_only: bool = False) -> dict[str, Tensor]:
        """Full tensors in Hugging Face names, on the CPU, on every rank (every rank must call it)."""
        trained = export_hf_state(self.model, self.layout)
        return trained if trainable_only else {**trained, **self.frozen}

    def snapshot_weights(self) -> dict[str, Tensor]:
        """`export_weights` copied into host buffers kept for the next call: at tp 1 on the CPU an
        exported tensor may be the live parameter itself."""
        return self._weight_snapshots.take(self.export_weights())

    def trained_names(self) -> list[str]:
        return [name for name in self.layout.hf_shapes
                if name not in self.frozen and not (self.layout.tied and name == self.layout.arch.lm_head)]

    def parameter_counts(self) -> tuple[int, int]:
        """(trained, all) parameters of the Hugging Face model it holds, from their shapes (a tied
        head once)."""
        shapes = self.layout.hf_shapes
        total = sum(math.prod(shapes[name]) for name in shapes
                    if not (self.layout.tied and name == self.layout.arch.lm_head))
        return sum(math.prod(shapes[name]) for name in self.trained_names()), total

    def refresh(self, store: WeightStore, held: int) -> int:
        """Every rank loads the same version: the newest any rank has seen, when newer than `held`."""
        while True:
            newest = int(self.group.max([float(store.latest_version())])[0])
            if newest <= held:
                return held
            try:
                weights = store.load_state(newest)
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

    def snapshot_state(self) -> dict | None:
        """The full weights (HF names), every rank's optimizer shard and the RNG, as a host copy
        training no longer changes (`host_snapshot.py`); every rank calls it, the leader gets it."""
        weights = self.export_weights()
        shards = self.optimizer.gather_state(self.group) if self.optimizer is not None else None
        if not self.group.is_leader:
            return None
        return self._snapshots.take({"model": weights, "optimizer": shards, "rng": torch.get_rng_state(),
                                    "layout": self._layout_key()})

    def reserve_snapshot(self) -> None:
        """Nothing ahead: the state is gathered (`export_weights`, the optimizer's shards) inside
        `snapshot_state`, a collective whose tensors are known only then."""

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


def _at_responses(per_position: Tensor, part: Experience) -> Tensor:
    """(n, R, ...) from `part`'s per-position outputs laid end to end: those predicting its response
    tokens (`padded_responses`)."""
    return padded_responses(per_position, [len(s) - 1 for s in part.sequences], part.prompt_lens, part.mask.shape[1])
