"""blocked_eager against eager at the 16 GB Mac's demo (issue 33), measured in one run: the embedded MiniLM
classifier's forward at the batch, length and dtype `plan --memory 16GB` recommends, per attention:
  - the peak, weights and inputs included (CUDA's max_memory_allocated; on the CPU the peak RSS above what was
    resident before the pass, plus the weights' and inputs' bytes: pages of P not yet written are not resident,
    so a peak in a fill step reads low there) beside `estimate_peak_bytes`, the estimate plan and run's
    preflight use;
  - whether blocked_eager's logits equal eager's bit for bit (no emulation);
  - emulated (full scale, --index-bits): the texts corrupted against the same attention unemulated (relative
    logit error above --threshold), the first one, and the calls the emulator altered.

Run: python benchmarks/blocked_attention.py --device cuda --memory 16GB          # the GPU run (H200)
     python benchmarks/blocked_attention.py --device cpu --batch-size 160 --max-length 256 --index-bits 26 \
         --dtype float32                                                          # a smoke test, minutes
What proves issue 33's GPU criteria: "blocked_eager: peak X GiB measured" with X <= 10, and the line
"emulated ...: same corrupted texts: True, same altered calls: True".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch

from mpsimpact.attention.blocked import NAME, samples_per_block
from mpsimpact.config import GIB
from mpsimpact.modes.emulator import emulate

ATTENTIONS = ("eager", NAME)


def recommended(memory: str, profile: str) -> tuple[int, int, str, str]:
    """(batch, length, dtype, command) of `plan sentiment --memory MEMORY`'s recommendation."""
    from mpsimpact.config import PlanConfig
    from mpsimpact.prediction.plan import build_plan_report
    from mpsimpact.runs.scenario import get_scenario

    report = build_plan_report(PlanConfig("sentiment", memory=memory, torch_profile=profile),
                               get_scenario("sentiment")())
    rec = report["memory"]["recommendation"]
    if rec["command"] is None:
        raise SystemExit(f"plan --memory {memory} recommends nothing: {rec['why']}")
    option = rec["option"]
    return option["batch_size"], option["max_length"], option["dtype"], rec["command"]


def status(field: str) -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field))


@contextlib.contextmanager
def peak_meter(device: str, held: int):
    """Yields a dict that gets "peak_gib": CUDA's peak allocation (all of it), or on the CPU (Linux) the peak
    RSS above the resident set before, plus `held` bytes (the weights and inputs, resident before)."""
    found: dict[str, float] = {}
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    else:
        before = status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")
    yield found
    if device == "cuda":
        torch.cuda.synchronize()
        found["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
    else:
        found["peak_gib"] = (status("VmHWM") - before + held) / GIB


def forward(module, inputs: dict, device: str, context=contextlib.nullcontext) -> tuple[torch.Tensor, dict]:
    held = sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers(), *inputs.values()))
    with peak_meter(device, held) as measured, torch.inference_mode(), context() as mode:
        start = time.perf_counter()
        logits = module(**inputs).float()
        if device == "cuda":
            torch.cuda.synchronize()
        measured["seconds"] = time.perf_counter() - start
    measured["records"] = [] if mode is None else [
        {"op": r.op, "a": list(r.a.shape), "b": list(r.b.shape), "kind": r.fault.kind, "rule": r.fault.rule}
        for r in mode.records]
    return logits.cpu(), measured


def corrupted(logits: torch.Tensor, reference: torch.Tensor, threshold: float) -> list[int]:
    """Texts whose relative logit error (max |x - ref| / max |ref|, per text) is above `threshold`."""
    error = (logits - reference).abs().amax(dim=1) / reference.abs().amax(dim=1)
    return torch.nonzero(error > threshold).flatten().tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--memory", default="16GB", help="take batch, length and dtype from plan --memory")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--max-length", type=int)
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--index-bits", type=int, default=32)
    parser.add_argument("--torch-profile", default="2.14.0")
    parser.add_argument("--threshold", type=float, default=1e-3)
    parser.add_argument("--out", help="also write blocked_attention.json to this folder")
    args = parser.parse_args()

    from mpsimpact.models.classifier import load_embedded_classifier, use_attention
    from mpsimpact.models.dataset import load_embedded
    from mpsimpact.prediction.demo_size import DTYPE_BYTES
    from mpsimpact.prediction.memory import estimate_peak_bytes
    from mpsimpact.runs.device import full_precision_reductions
    from mpsimpact.runs.device_pass import build_batch

    command = None
    if args.batch_size is None:
        args.batch_size, args.max_length, args.dtype, command = recommended(args.memory, args.torch_profile)
    dtype = getattr(torch, args.dtype or "float32")
    model = load_embedded_classifier()
    data = load_embedded("heldout")
    texts, _, _ = build_batch(data.texts, data.labels, args.batch_size)
    encoded = model.tokenizer(texts, truncation=True, max_length=args.max_length, padding="max_length",
                              return_tensors="pt")
    module = model.module.to(device=args.device, dtype=dtype)
    inputs = {k: encoded[k].to(args.device) for k in ("input_ids", "attention_mask")}
    samples = samples_per_block(model.heads, args.max_length)
    print(f"geometry: {args.batch_size} x {args.max_length} {dtype} on {args.device}"
          + (f" (plan --memory {args.memory}: {command})" if command else ""), flush=True)
    results: dict = {"batch": args.batch_size, "length": args.max_length, "dtype": str(dtype), "command": command,
                     "device": torch.cuda.get_device_name(0) if args.device == "cuda" else args.device}
    logits = {}
    emulation = lambda: emulate(index_bits=args.index_bits, profile=args.torch_profile)  # noqa: E731
    with full_precision_reductions():
        for attention in (NAME, "eager"):
            use_attention(module, attention, samples)
            with torch.inference_mode():  # warm-up: one-time allocations stay out of the peaks
                module(**{k: v[:2] for k, v in inputs.items()})
            estimate = estimate_peak_bytes(model.config, args.batch_size, args.max_length,
                                           DTYPE_BYTES[args.dtype or "float32"], attention) / GIB
            logits[attention], plain = forward(module, inputs, args.device)
            logits[f"{attention} emulated"], emulated = forward(module, inputs, args.device, emulation)
            bad = corrupted(logits[f"{attention} emulated"], logits[attention], args.threshold)
            results[attention] = {"estimate_gib": estimate, "plain": plain, "emulated": emulated,
                                  "corrupted": len(bad), "first_corrupted": bad[0] if bad else None,
                                  "corrupted_texts": bad}
            print(f"{attention}: peak {plain['peak_gib']:.2f} GiB measured, {estimate:.2f} GiB estimated "
                  f"(estimate / measured {estimate / plain['peak_gib']:.3f}); forward {plain['seconds']:.2f} s; "
                  f"emulated: peak {emulated['peak_gib']:.2f} GiB, {len(bad)} of {args.batch_size} texts "
                  f"corrupted, first {bad[0] if bad else None}, {len(emulated['records'])} altered calls",
                  flush=True)
        use_attention(module, "eager")
    mine, eager = results[NAME], results["eager"]
    same_texts = mine["corrupted_texts"] == eager["corrupted_texts"]
    same_calls = mine["emulated"]["records"] == eager["emulated"]["records"]
    difference = (logits[NAME] - logits["eager"]).abs().max().item()
    results.update(bitwise_equal=torch.equal(logits[NAME], logits["eager"]), max_abs_difference=difference,
                   same_corrupted_texts=same_texts, same_altered_calls=same_calls,
                   emulated_bitwise_equal=torch.equal(logits[f"{NAME} emulated"], logits["eager emulated"]),
                   time_ratio=mine["plain"]["seconds"] / eager["plain"]["seconds"],
                   peak_ratio=mine["plain"]["peak_gib"] / eager["plain"]["peak_gib"])
    print(f"{NAME} vs eager, unemulated: bitwise equal {results['bitwise_equal']} (max |difference| "
          f"{difference:.3g}); time {results['time_ratio']:.2f}x, peak {results['peak_ratio']:.2f}x")
    print(f"emulated torch {args.torch_profile} at {args.index_bits} bits: same corrupted texts: {same_texts}, "
          f"same altered calls: {same_calls}, emulated logits bitwise equal: {results['emulated_bitwise_equal']}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "blocked_attention.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
