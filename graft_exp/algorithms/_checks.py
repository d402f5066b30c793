"""Cheap input validation shared by the algorithm functions.

Every check raises ``ValueError`` with a message naming the argument, what was found and what was
expected. They run every training step, so each is at most one reduction over the tensor.
"""

from __future__ import annotations

import torch


def check_ndim(name: str, tensor: torch.Tensor, ndim: int) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-dimensional, got shape {tuple(tensor.shape)}")


def check_same_shape(name: str, tensor: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if tensor.shape != ref.shape:
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)} but {ref_name} has shape {tuple(ref.shape)}; "
            "they must match"
        )


def check_finite(name: str, tensor: torch.Tensor, where: torch.Tensor | None = None) -> None:
    """Reject NaN/inf; with ``where``, only the entries where it is true are checked (padding may hold
    anything)."""
    ok = torch.isfinite(tensor)
    if where is not None:
        ok = ok | ~where.bool()
    if not bool(ok.all()):
        raise ValueError(f"{name} contains NaN or inf; expected finite values")


def check_binary(name: str, tensor: torch.Tensor) -> None:
    if not bool(((tensor == 0) | (tensor == 1)).all()):
        raise ValueError(f"{name} must be binary (every entry 0 or 1), got values {tensor.unique().tolist()[:8]}")


def check_group_size(n: int) -> None:
    if not isinstance(n, int) or n < 2:
        raise ValueError(f"group size n must be an int >= 2 (GRPO needs at least two responses), got {n!r}")


def check_success_counts(name: str, k: torch.Tensor, n: int) -> None:
    check_ndim(name, k, 1)
    if k.dtype.is_floating_point or k.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor of success counts, got dtype {k.dtype}")
    if k.numel() and not bool(((k >= 0) & (k <= n)).all()):
        raise ValueError(f"{name} must hold success counts in [0, n={n}], got min {int(k.min())}, max {int(k.max())}")


def check_unit_interval(name: str, value: float) -> None:
    if not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name} must lie in [0, 1], got {value!r}")


def check_clip(clip_low: float, clip_high: float) -> None:
    if not 0.0 <= float(clip_low) <= 1.0:
        raise ValueError(f"clip_low must lie in [0, 1] (the ratio's lower bound is 1 - clip_low), got {clip_low!r}")
    if not float(clip_high) >= 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high!r}")


def check_mask_like(name: str, mask: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    check_same_shape(name, mask, ref_name, ref)
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(f"{name} must be a 0/1 or boolean mask")


def check_row_vector(name: str, tensor: torch.Tensor, rows: int) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.shape != (rows,):
        raise ValueError(f"{name} must have shape ({rows},) (one entry per sequence), got {tuple(tensor.shape)}")
