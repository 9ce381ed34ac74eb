"""The reference: CPU fp32 outputs computed in small length-sorted chunks (padding only to each
chunk's longest text, which the attention mask makes exact), cached on disk by everything that
affects them."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mpsimpact.output.files import atomic_write_bytes

CHUNK = 64


def run_chunked(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    tokenizer: Any,
    texts: Sequence[str],
    max_length: int,
    *,
    chunk: int = CHUNK,
    advance: Callable[[int], None] | None = None,
    device: str = "cpu",
    padding: str = "longest",
) -> np.ndarray:
    """`fn(input_ids, attention_mask)` over `texts` truncated at `max_length`, in chunks of
    similar length; rows come back in the order of `texts`. `padding="max_length"` pads every chunk
    to `max_length`, exactly as the device pass does (the same-dtype reference of half precision)."""
    lengths = [len(ids) for ids in tokenizer(list(texts), truncation=True, max_length=max_length)["input_ids"]]
    order = np.argsort(lengths, kind="stable")
    rows: list[np.ndarray] = [None] * len(texts)  # type: ignore[list-item]
    with torch.inference_mode():
        for start in range(0, len(texts), chunk):
            picked = order[start : start + chunk]
            enc = tokenizer([texts[i] for i in picked], truncation=True, max_length=max_length, padding=padding, return_tensors="pt")
            out = fn(enc["input_ids"].to(device), enc["attention_mask"].to(device)).float().cpu().numpy()
            for row, index in zip(out, picked):
                rows[index] = row
            if advance:
                advance(len(picked))
    return np.stack(rows)


def model_fingerprint(module: torch.nn.Module) -> str:
    """A cheap, content-based hash of a module's parameters (sums and leading values)."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, tensor in module.state_dict().items():
            flat = tensor.detach().reshape(-1)
            digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}{float(flat.double().sum())}".encode())
            digest.update(flat[:32].double().numpy().tobytes())
    return digest.hexdigest()[:16]


def cache_dir() -> Path:
    from mpsimpact.engine.release import cache_root

    return cache_root() / "reference"


def cache_key(fingerprint: str, texts: Sequence[str], max_length: int) -> str:
    import transformers

    payload = json.dumps(
        {"model": fingerprint, "texts": hashlib.sha256("\0".join(texts).encode()).hexdigest(), "max_length": max_length,
         "torch": torch.__version__, "transformers": transformers.__version__},
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def cached_reference(key: str) -> np.ndarray | None:
    path = cache_dir() / f"{key}.npy"
    return np.load(path) if path.is_file() else None


def store_reference(key: str, logits: np.ndarray) -> None:
    import io

    buffer = io.BytesIO()
    np.save(buffer, logits)
    atomic_write_bytes(cache_dir() / f"{key}.npy", buffer.getvalue())


def same_dtype_reference(module: torch.nn.Module, tokenizer: Any, texts: Sequence[str], run_length: int, device: str,
                         advance: Callable[[int], None] | None = None) -> np.ndarray:
    """Half precision's judge: the module as it is (dtype, device), over small batches of texts far
    below every limit, padded to the run length exactly as the device pass is; no emulation, no
    guard: an independent computation on the same kernels."""
    return run_chunked(module, tokenizer, texts, run_length, advance=advance, device=device, padding="max_length")
