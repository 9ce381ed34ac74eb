"""The memory budget of one attention piece: how many bytes of transient scores (and their softmax) one
piece of mps_safe_eager or of the guard's SDPA split may hold at once. See Note [Attention memory budget]."""

from __future__ import annotations

import torch

from mpsimpact.variables import attention_budget

# Note [Attention memory budget]
# mps_safe_eager and the guard's SDPA split cut attention into pieces below MPS's index limits
# (Note [MPS 32-bit index faults]); those limits alone allow pieces of ~2**32 scores, 16 GiB in fp32,
# which is what runs a 32 GB Mac out of memory. A piece's transients (scores in the query dtype, the
# float32 softmax, the probabilities cast back) are bounded by a budget in bytes instead:
#   1. `set_memory_budget(n)` (None: back to the default), else
#   2. the environment variable MPSIMPACT_ATTENTION_BUDGET (bytes; suffixes K, M, G for KiB, MiB, GiB),
#   3. else, by device: cuda a quarter of the free memory, mps a quarter of
#      recommended_max_memory() - current_allocated_memory(), both at most 1 GiB (bigger pieces buy no
#      speed and cost peak); cpu and others 256 MiB; meta unbounded (shapes only).
# The index limits stay an upper bound: the budget only makes pieces smaller, never larger. Not counted:
# the piece's queries (G*r x D, a copy) and, with key blocks, the float32 accumulator (G*r x Dv), both
# small against the scores at real sizes; nor the caller's output tensor and inputs.

CPU_DEFAULT = 256 * 2**20
DEVICE_CAP = 2**30
SCORE_BYTES_FP32 = 4  # the softmax runs in float32 (transformers' eager_attention_forward)

_budget: int | None = None


def set_memory_budget(n_bytes: int | None) -> None:
    """Sets the bytes of transient scores one attention piece may hold (None: the default).

    Raises:
        ValueError: when n_bytes is not None and below 1.
    """
    global _budget
    if n_bytes is not None and n_bytes < 1:
        raise ValueError(f"The attention memory budget must be >= 1 byte, got {n_bytes}.")
    _budget = n_bytes


def memory_budget(device: torch.device | str | None = None) -> int | None:
    """Bytes of transient scores one piece may hold on `device`; None means unbounded (meta tensors)."""
    if _budget is not None:
        return _budget
    if (env := attention_budget()) is not None:
        return env
    kind = torch.device(device).type if device is not None else "cpu"
    if kind == "meta":
        return None
    if kind == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return max(2**20, min(DEVICE_CAP, free // 4))
    if kind == "mps" and hasattr(torch, "mps") and torch.backends.mps.is_available():
        free = torch.mps.recommended_max_memory() - torch.mps.current_allocated_memory()
        return max(2**20, min(DEVICE_CAP, free // 4))
    return CPU_DEFAULT


def bytes_per_score(dtype: torch.dtype) -> int:
    """Transient bytes per score element of one piece, all alive at the softmax's cast: the masked scores
    and the piece's mask rows in `dtype` (see Note [Lazy eager mask]), the float32 softmax and the
    probabilities cast back to `dtype`."""
    size = torch.empty((), dtype=dtype, device="meta").element_size()
    return 3 * size + SCORE_BYTES_FP32


def budget_scores(query: torch.Tensor) -> int | None:
    """Score elements one attention piece over `query` may hold (None: unbounded)."""
    budget = memory_budget(query.device)
    return None if budget is None else max(1, budget // bytes_per_score(query.dtype))


def target_budget(device: str = "mps") -> int:
    """The budget a run on `device` would use, for predictions made elsewhere (check on a Linux host): the
    setting or the environment variable, the device's own figure where it is this machine's, else the
    GPU default's cap (what a Mac with 4 GiB or more free gets)."""
    found = memory_budget(device)
    if _budget is not None or attention_budget() is not None:
        return found
    here = device == "mps" and torch.backends.mps.is_available() or device == "cuda" and torch.cuda.is_available()
    return found if here and found is not None else DEVICE_CAP


def bytes_per_score_of(name: str) -> int:
    """`bytes_per_score` of a dtype named as TensorSpec names it ("float32", "bfloat16")."""
    found = getattr(torch, name.removeprefix("torch."), None)
    return bytes_per_score(found if isinstance(found, torch.dtype) else torch.float32)
