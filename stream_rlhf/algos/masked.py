"""Statistics over the valid tokens of a `(B, T)` tensor, the rest ignored.

A mask is 0/1 float or bool with the shape of the data; values at masked-out positions never reach
a result (not even NaN or inf), and an empty mask gives 0 rather than NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor


def where_valid(x: Tensor, mask: Tensor) -> Tensor:
    """`x` where `mask` is set, 0 elsewhere: a loss's inputs made safe before any arithmetic, so
    that whatever sits at a masked-out position (NaN, inf) reaches no value and no gradient
    (the gradient of `x` there is exactly 0)."""
    return torch.where(mask.bool(), x, 0.0)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` over positions where `mask` is set, over all of them (`dim=None`, a scalar) or
    along `dim` (that dimension reduced). x, mask: same shape, e.g. `(B, T)`. Empty -> 0."""
    valid = mask.bool()
    total = torch.where(valid, x, 0.0)
    if dim is None:
        return total.sum() / valid.sum().clamp(min=1)
    return total.sum(dim) / valid.sum(dim).clamp(min=1)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """`x` scaled to unit std (population std, unbiased=False) over all masked elements, and also
    shifted to mean 0 when `shift_mean` (otherwise the mean is kept). x, mask: same shape, e.g.
    `(B, T)`; the result has that shape with masked-out positions 0."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, 0.0)
