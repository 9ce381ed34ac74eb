"""The probe `mpsimpact matrix` runs inside each transformers environment: which attention a model gets,
which bmm/mm/SDPA calls it makes (meta tensors, full geometry), their outcome per torch release, and a
tiny emulated run under each guard mode. Run as `python -m mpsimpact.upgrade.probe` (a JSON job on
stdin, one JSON object on stdout); it uses only transformers APIs that exist from 4.44 on."""

from __future__ import annotations

import contextlib
import json
import re
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

PROBE_SCHEMA = 1
# The default model asked for attention weights: 4.41 .. 4.57 silently fall back to eager for it.
WITH_WEIGHTS = "default, output_attentions"
# Each implementation probed, and what it asks transformers for (None: the version's default).
IMPLEMENTATIONS = {"eager": "eager", "sdpa": "sdpa", WITH_WEIGHTS: None}
# A tiny random BERT (tests/tiny.py's sizes): hidden 16 over 4 heads, 2 layers, 64 positions.
TINY_BERT = {"vocab_size": 100, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 32, "max_position_embeddings": 64, "hidden_dropout_prob": 0.0,
             "attention_probs_dropout_prob": 0.0,
             "initializer_range": 0.5}  # peaked attention: near-uniform P would hide which row a wrap reads
# Its emulated batch: P is (24 * 4, 32, 32), 98,304 > 2**16 elements, so P V wraps from batch-head
# ceil(2**16 / (32 * 32)) = 64, text 16; fused SDPA's 98,304 score elements are above 2**16 too.
TINY_RUN = {"batch": 24, "length": 32, "index_bits": 16}
TOLERANCE = {"atol": 1e-5, "rtol": 1e-4}


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def op_path(plan: Any) -> list[dict[str, Any]]:
    """The calls of a trace as distinct signatures in first-seen order (layers folded into `*`)."""
    seen: dict[tuple, dict[str, Any]] = {}
    for call in plan.trace:
        entry = {
            "op": call.op, "module": re.sub(r"\.\d+(\.|$)", r".*\1", call.module),
            "a": {"shape": list(call.a.shape), "layout": call.a.layout},
            "b": {"shape": list(call.b.shape), "layout": call.b.layout},
            "within_sdpa": call.within is not None,
        }
        seen.setdefault(json.dumps(entry, sort_keys=True), entry | {"count": 0})["count"] += 1
    return list(seen.values())


def outcomes(plan: Any, batch: int, heads: int, profiles: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per torch profile (by the string the job names it with): the forward pass's outcome and the faulting
    calls, grouped."""
    from mpsimpact.prediction.outcome import predict

    result = {}
    for ref, profile in profiles.items():
        decided = plan.under(profile)
        forward = predict(decided, batch, heads, "forward")
        faults = Counter((c.op, re.sub(r"\.\d+(\.|$)", r".*\1", c.module), c.fault.kind, c.fault.rule)
                         for c in decided.faults)
        result[ref] = {
            "outcome": forward.outcome, "message": forward.describe(),
            "first_corrupted_text": forward.first_corrupted_text,
            "first_corrupted_head": forward.first_corrupted_head,
            "corrupted_count": forward.corrupted_count if forward.first_corrupted_text is not None else None,
            "faults": [dict(zip(("op", "module", "kind", "rule"), k), count=n) for k, n in faults.items()]}
    return result


def probe_implementation(config: Any, model_class: Any, job: dict[str, Any], name: str,
                         resolved: dict[str, Any]) -> dict[str, Any]:
    """One attention implementation: what the model gets, its op path and outcomes per profile.

    transformers' mask helpers skip the mask when all of it is ones, which reads values that meta
    tensors lack (4.x for SDPA; 5.x with a mask given). Under torch.jit tracing they build the mask
    without that check, as for a padded batch; no matmul changes.
    """
    from unittest import mock

    from mpsimpact.prediction.meta_model import build_meta_model, trace_meta

    requested = IMPLEMENTATIONS[name]
    try:
        model = build_meta_model(model_class, config, requested)
    except (ValueError, ImportError) as error:  # e.g. an architecture without SDPA in this version
        return {"requested": requested or "default", "error": _first_line(error)}
    size = job["batch_size"], job["max_length"]
    forward = {"output_attentions": True} if requested is None else {}
    try:
        plan, workaround = trace_meta(model, *size, mask="2-D ones", profile=resolved[None], **forward), False
    except RuntimeError as error:
        if "meta tensors" not in str(error):
            raise
        with mock.patch("torch.jit.is_tracing", return_value=True):
            plan, workaround = trace_meta(model, *size, mask="2-D ones", profile=resolved[None], **forward), True
    families = {call.family for call in plan.trace}  # which attention the traced forward ran: SDPA, bmm or none
    return {
        "requested": requested or "default", "gets": model.config._attn_implementation,
        "runs": "sdpa" if "sdpa" in families else "eager" if "bmm" in families else "none",
        "calls": len(plan.calls), "meta_mask_workaround": workaround, "op_path": op_path(plan),
        "outcomes": outcomes(plan, job["batch_size"], config.num_attention_heads,
                             {ref: resolved[ref] for ref in job["profiles"]})}


def _emulated(model: Any, ids: Any, index_bits: int, profile: Any,
              guard_mode: str | None) -> tuple[Any, Any, Any]:
    """(output or the exception, the emulator, the guard) of one forward under emulated MPS."""
    import torch

    from mpsimpact.modes.emulator import emulate
    from mpsimpact.modes.guard import guard

    emu = active = None
    try:
        with torch.no_grad(), emulate(index_bits, profile=profile) as emu:
            guarded = (guard(guard_mode, index_bits=index_bits, profile=profile) if guard_mode
                       else contextlib.nullcontext())
            with guarded as active:
                return model(input_ids=ids).last_hidden_state, emu, active
    except RuntimeError as error:  # EmulatedMpsError, NotEmulatedError, OversizedOpError
        return error, emu, active


def guard_checks(model: Any, ids: Any, plain: Any, index_bits: int, profile: Any) -> dict[str, Any]:
    """Guard off must fault (the emulator records it), raise must stop, chunk must equal `plain`."""
    import torch

    from mpsimpact.errors import NotEmulatedError, OversizedOpError

    out, emu, _ = _emulated(model, ids, index_bits, profile, None)
    off = {"faulted_calls": [f"{r.describe()}: {r.fault.kind} ({r.fault.rule})" for r in emu.records]}
    if isinstance(out, NotEmulatedError):
        off |= {"status": "not_emulated", "message": _first_line(out)}
    elif isinstance(out, BaseException):
        off |= {"status": "error", "message": _first_line(out)}
    else:
        bad = ((out - plain).abs().amax(dim=(1, 2)) > TOLERANCE["atol"]).nonzero().flatten().tolist()
        off |= {"status": "corrupted" if bad else "clean", "first_corrupted_text": bad[0] if bad else None,
                "corrupted_count": len(bad)}
    out, _, active = _emulated(model, ids, index_bits, profile, "raise")
    stopped = isinstance(out, OversizedOpError)
    message = _first_line(out) if isinstance(out, BaseException) else ""
    raised = {"status": "stopped" if stopped else "completed", "message": message}
    out, emu, active = _emulated(model, ids, index_bits, profile, "chunk")
    equal = not isinstance(out, BaseException) and torch.allclose(out, plain, **TOLERANCE)
    chunk = {"status": "equal" if equal else "differs" if not isinstance(out, BaseException) else "error",
             "chunked_calls": len(active.chunked) if active is not None else 0,
             "emulator_records": len(emu.records) if emu else 0,
             **({"message": _first_line(out)} if isinstance(out, BaseException) else {})}
    return {"off": off, "raise": raised, "chunk": chunk, "guard_ok": bool(off["faulted_calls"]) and stopped and equal}


def emulated_runs(release: str, profile: Any) -> dict[str, Any]:
    """The tiny BERT under emulated MPS (`release`, resolved as `profile`), with this version's default
    attention and with eager."""
    import torch
    from transformers import AutoModel, BertConfig

    ids = torch.randint(1, TINY_BERT["vocab_size"], (TINY_RUN["batch"], TINY_RUN["length"]),
                        generator=torch.Generator().manual_seed(0))  # (B, L)
    runs = {}
    for label, attention in (("default", None), ("eager", "eager")):
        torch.manual_seed(0)
        kwargs = {} if attention is None else {"attn_implementation": attention}
        model = AutoModel.from_config(BertConfig(**TINY_BERT), **kwargs).eval()
        with torch.no_grad():
            plain = model(input_ids=ids).last_hidden_state  # (B, L, 16)
        runs[label] = {"attention": model.config._attn_implementation,
                       **guard_checks(model, ids, plain, TINY_RUN["index_bits"], profile)}
    return {"model": "tiny random BERT (hidden 16, 4 heads, 2 layers)", "profile": release, **TINY_RUN,
            "runs": runs}


def probe(job: dict[str, Any]) -> dict[str, Any]:
    """Everything the matrix shows for the transformers importable here (see the module docstring)."""
    started = time.perf_counter()
    import torch
    import transformers

    imported = time.perf_counter()
    from mpsimpact.engine.release import resolve_profile
    from mpsimpact.prediction.meta_model import build_meta_model, load_model_config

    config, _ = load_model_config(job["model"])
    # Each release once in this process, for every implementation and emulated run; None: the installed torch's,
    # which each trace is decided under first (its "calls").
    refs = dict.fromkeys([None, *job["profiles"], job["emulated_profile"]])
    resolved = {ref: resolve_profile(ref) for ref in refs}
    auto = (transformers.AutoModelForSequenceClassification if job["task"] == "sequence-classification"
            else transformers.AutoModel)
    result: dict[str, Any] = {
        "schema": PROBE_SCHEMA,
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                     "python": sys.version.split()[0]},
        "paths": {"transformers": transformers.__file__, "torch": torch.__file__,
                  "mpsimpact": str(Path(__file__).resolve().parents[1] / "__init__.py")},
        "model_type": config.model_type, "heads": config.num_attention_heads,
        "layers": config.num_hidden_layers,
        "default_attention": build_meta_model(auto, config).config._attn_implementation,
        "implementations": {name: probe_implementation(config, auto, job, name, resolved)
                            for name in IMPLEMENTATIONS}}
    traced = time.perf_counter()
    result["emulated"] = emulated_runs(job["emulated_profile"], resolved[job["emulated_profile"]])
    result["timing"] = {"import_s": round(imported - started, 2), "trace_s": round(traced - imported, 2),
                        "emulated_s": round(time.perf_counter() - traced, 2)}
    return result


def main() -> None:
    """Reads the job from stdin; writes one JSON object to stdout (library chatter goes to stderr)."""
    job = json.load(sys.stdin)
    stdout = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        try:
            result = probe(job)
        except Exception as error:  # noqa: BLE001 - every failure becomes the row's reason
            traceback.print_exc()
            result = {"schema": PROBE_SCHEMA, "error": _first_line(error)}
    stdout.write(json.dumps(result) + "\n")
    stdout.flush()


if __name__ == "__main__":
    main()
