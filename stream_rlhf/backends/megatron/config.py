"""The megatron engine's parallel sizes (`placement.stages.<stage>.megatron`) and the checks that
they fit the stage's ranks and the model, made before any process starts.

    megatron: {tp: 2, pp: 1, cp: 1}    # dp = ranks / (tp * pp * cp)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from msgspec import Meta

from stream_rlhf.config import ConfigError, check_fields


@dataclass(frozen=True)
class MegatronConfig:
    """The megatron engine's parallel sizes; data parallel is what the stage's ranks leave."""

    tp: Annotated[int, Meta(ge=1)] = 1
    """Tensor-parallel size: attention heads, key/value groups, the MLP and the vocabulary are split
    over this many ranks."""
    pp: Annotated[int, Meta(ge=1)] = 1
    """Pipeline-parallel size: the decoder layers are split into this many consecutive stages."""
    cp: Annotated[int, Meta(ge=1)] = 1
    """Context-parallel size: each sample's sequence is split over this many ranks in megatron's
    load-balanced layout (2 x cp chunks; the engine right-pads every batch to a multiple of 2 x cp),
    keys and values all-gathered in each attention layer (`cp_attention.py`), only the per-token
    log-probs or values gathered back (`kernels/cp_gather.py`)."""
    recompute: bool = False
    """Recompute each decoder layer's activations in the backward pass (megatron's full, uniform
    activation recompute): less memory, one more forward of the layers (on the CPU the random state
    is the CPU generator's: `shim.py`, shim 7)."""

    def __post_init__(self) -> None:
        check_fields(self)

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp

    def data_parallel(self, ranks: int) -> int:
        return ranks // self.model_parallel


def check_parallel(parallel: MegatronConfig, ranks: int, heads: int, kv_heads: int, layers: int, key: str) -> None:
    """Refuse sizes that cannot split this model over these ranks, naming `key` and the numbers."""
    check_ranks(parallel, ranks, key)
    check_model(parallel, heads, kv_heads, layers, key)


def check_ranks(parallel: MegatronConfig, ranks: int, key: str) -> None:
    if ranks % parallel.model_parallel:
        raise ConfigError(f"{key}: tp x pp x cp = {parallel.tp} x {parallel.pp} x {parallel.cp} = "
                          f"{parallel.model_parallel} does not divide the stage's ranks={ranks}")


def check_model(parallel: MegatronConfig, heads: int, kv_heads: int, layers: int, key: str) -> None:
    if heads % parallel.tp or kv_heads % parallel.tp:
        raise ConfigError(f"{key}.tp={parallel.tp}: does not divide the model's {heads} attention heads and "
                          f"{kv_heads} key/value heads")
    if layers % parallel.pp:
        raise ConfigError(f"{key}.pp={parallel.pp}: does not divide the model's {layers} layers")
