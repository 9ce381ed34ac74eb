"""The reference: CPU fp32 outputs computed in small length-sorted chunks (padding only to each
chunk's longest text, which the attention mask makes exact), cached on disk by everything that
affects them; each cache entry carries its key, shape, dtype and sha256, checked when read."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mpsimpact.bounds import FileProblemError, parse_json, read_file_bytes
from mpsimpact.engine.release import cache_root
from mpsimpact.output.files import atomic_write_bytes, remove_dead_partials, target_problem, warn

CHUNK = 64
# A cache entry: MAGIC, a JSON header line, the float32 array's bytes; see encode_entry.
MAGIC = b"MPSIMPACT-REFERENCE 1\n"
MAX_HEADER = 4096
MAX_ENTRY_BYTES = 4 << 30  # one cached reference: 65,536 texts x a 384-wide fp32 embedding is 100 MB
SUFFIX = ".ref"


def run_chunked(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], tokenizer: Any, texts: Sequence[str],
                max_length: int, *, chunk: int = CHUNK, advance: Callable[[int], None] | None = None,
                device: str = "cpu", padding: str = "longest") -> np.ndarray:
    """`fn(input_ids, attention_mask)` over `texts` truncated at `max_length`, in chunks of
    similar length; rows come back in the order of `texts`. `padding="max_length"` pads every chunk
    to `max_length`, exactly as the device pass does (the same-dtype reference of half precision)."""
    lengths = [len(ids) for ids in tokenizer(list(texts), truncation=True, max_length=max_length)["input_ids"]]
    order = np.argsort(lengths, kind="stable")
    rows: list[np.ndarray] = [None] * len(texts)  # type: ignore[list-item]
    with torch.inference_mode():
        for start in range(0, len(texts), chunk):
            picked = order[start : start + chunk]
            enc = tokenizer([texts[i] for i in picked], truncation=True, max_length=max_length, padding=padding,
                            return_tensors="pt")
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
    """Where cached references live: <cache_root>/reference."""
    return cache_root() / "reference"


def cache_key(fingerprint: str, texts: Sequence[str], max_length: int) -> str:
    import transformers

    texts_digest = hashlib.sha256("\0".join(texts).encode()).hexdigest()
    payload = json.dumps({"model": fingerprint, "texts": texts_digest, "max_length": max_length,
                          "torch": torch.__version__, "transformers": transformers.__version__}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def entry_path(key: str) -> Path:
    return cache_dir() / f"{key}{SUFFIX}"


def encode_entry(key: str, logits: np.ndarray) -> bytes:
    """An entry's bytes: MAGIC, one JSON header line (key, shape, dtype, byte count, sha256), the array."""
    payload = np.ascontiguousarray(logits, dtype=np.float32).tobytes()
    header = {"key": key, "shape": list(logits.shape), "dtype": "<f4", "bytes": len(payload),
              "sha256": hashlib.sha256(payload).hexdigest()}
    return MAGIC + json.dumps(header).encode() + b"\n" + payload


def decode_entry(data: bytes, key: str, rows: int | None = None, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """The array of an entry, every header field checked against its payload and against what its key
    stands for: `rows` texts, or the whole `shape` (texts, and the model's width: its labels).

    Raises:
        ValueError: what is off, as words that follow "the cached reference ... ".
    """
    if not data:
        raise ValueError("is empty")
    if not data.startswith(MAGIC):
        raise ValueError("has no mpsimpact reference header (damaged, or written by an older mpsimpact)")
    end = data.find(b"\n", len(MAGIC), len(MAGIC) + MAX_HEADER)
    try:
        header = parse_json(data[len(MAGIC):end]) if end > 0 else None
        stored, size, digest = tuple(header["shape"]), header["bytes"], header["sha256"]
        stored_key, dtype = header["key"], np.dtype(header["dtype"])
    except (ValueError, TypeError, KeyError, RecursionError):
        raise ValueError("has a damaged header") from None
    if stored_key != key:
        raise ValueError(f"holds the entry of another key ({str(stored_key)[:24]})")
    if dtype != np.dtype("<f4") or not stored or not all(type(n) is int and n >= 0 for n in stored):
        raise ValueError(f"has a damaged header (shape {list(stored)[:8]}, dtype {dtype})")
    rows = shape[0] if shape is not None else rows
    if rows is not None and stored[0] != rows:
        raise ValueError(f"has {stored[0]} rows, this run has {rows} texts")
    if shape is not None and stored != tuple(shape):
        raise ValueError(f"has shape {list(stored)[:8]}, where this key's texts and model give {list(shape)} "
                         "(another width)")
    payload, needed = data[end + 1:], math.prod(stored) * dtype.itemsize
    if size != needed or len(payload) != needed:
        raise ValueError(f"is truncated or padded ({len(payload)} bytes of data; its shape {list(stored)} needs "
                         f"{needed})")
    if hashlib.sha256(payload).hexdigest() != digest:
        raise ValueError("is damaged (its sha256 does not match its data)")
    array = np.frombuffer(payload, dtype=dtype).reshape(stored).copy()
    if not np.isfinite(array).all():
        raise ValueError("holds NaN or infinite values")
    return array


def cached_reference(key: str, rows: int | None = None, shape: tuple[int, ...] | None = None) -> np.ndarray | None:
    """The cached reference of `key` (with `rows` rows, or of the whole `shape`, when given), or None: absent,
    or unusable, which one line on stderr says (the bad entry is removed and the caller recomputes it). Never
    raises for the cache's sake: it is only an optimisation."""
    path = entry_path(key)
    if not os.path.lexists(path):
        return None
    # a folder, a FIFO, a link: never read, never replaced (Note [Only regular files])
    problem = target_problem(path)
    if problem is not None:
        problem, it = ("is a folder, not a file", "the folder") if path.is_dir() else (problem, "it")
        warn(f"the cached reference '{path}' {problem}; computing the reference without the cache (remove {it} to "
             "cache it again).")
        return None
    try:
        data = read_file_bytes(path, MAX_ENTRY_BYTES, "a cached reference")
    except FileProblemError as error:  # unreadable, too big, or the cache folder is a file
        warn(f"the cached reference '{path}' {error}; recomputing it.")
        return None
    try:
        return decode_entry(data, key, rows, shape)
    except ValueError as problem:
        warn(f"the cached reference '{path}' {problem}; recomputing it.")
        with contextlib.suppress(OSError):
            path.unlink()
        return None


def store_reference(key: str, logits: np.ndarray) -> bool:
    """Caches `logits` under `key`, atomically; returns whether it did. A cache folder that cannot be
    written means no cache, said in one line on stderr, never a failure."""
    path = entry_path(key)
    if target_problem(path) is not None:
        return False  # said when it was read
    if not np.isfinite(logits).all():
        warn("the reference holds NaN or infinite values; it is not cached.")
        return False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_dead_partials(path.parent)
        atomic_write_bytes(path, encode_entry(key, logits))
    except OSError as error:
        warn(f"the reference cache '{cache_dir()}' cannot be written ({error.strerror or error}); "
             "continuing without it.")
        return False
    return True


def reference_logits(model, texts: list[str], run_length: int, advance=None) -> tuple[np.ndarray, bool]:
    """CPU fp32 reference at the run length, from the on-disk cache when present (an entry of another shape
    than these texts by this model's labels, or of other rows for a model without labels, an embedder, is
    damage: removed and recomputed)."""
    key, labels = cache_key(model_fingerprint(model.module), texts, run_length), len(model.label_names)
    cached = cached_reference(key, shape=(len(texts), labels)) if labels else cached_reference(key, len(texts))
    if cached is not None:
        return cached, True
    logits = run_chunked(model.module, model.tokenizer, texts, run_length, advance=advance)
    store_reference(key, logits)
    return logits, False


def device_reference(model, texts: list[str], run_length: int, device: str, boundary: int | None,
                     advance=None) -> tuple[np.ndarray, dict]:
    """A chunked, unemulated reference on the device itself (for big GPUs), spot-checked on the
    CPU on a sample that includes the texts around the predicted boundary."""
    from mpsimpact.runs.metrics import relative_error

    logits = run_chunked(model.module, model.tokenizer, texts, run_length, advance=advance, device=device)
    around = range(max(0, (boundary or 0) - 8), min(len(texts), (boundary or 0) + 8))
    drawn = np.random.default_rng(0).choice(len(texts), size=min(48, len(texts)), replace=False).tolist()
    sample = sorted(set(around) | set(drawn))
    cpu = run_chunked(model.module.to("cpu"), model.tokenizer, [texts[i] for i in sample], run_length)
    model.module.to(device)
    return logits, {"texts": len(sample), "includes_boundary": boundary is not None,
                    "max_relative_difference": float(relative_error(logits[sample], cpu).max())}
