"""Long context, as ratios measured in one run: a Llama-3-shaped decoder (head dim 128, grouped
key/value heads, random weights) at 8k to 64k tokens, plain eager attention vs mps_safe_eager (pieces
below the index limits and within a memory budget, see Note [Attention memory budget]) vs eager under
guard("chunk") vs fused SDPA. With --check-70k (the GPU acceptance run of issue 25): at 70,000 tokens one
head's scores are 4.9e9 elements > 2**32, and emulated eager is wrong while guard("chunk") and
mps_safe_eager equal the plain result. With --peak-rss (issue 36, CPU): one layer's forward per condition,
each in a fresh process, its peak resident memory (ru_maxrss) and seconds.

Run: python benchmarks/long_context.py --device cpu --lengths 8192,16384 --reps 3
     python benchmarks/long_context.py --device cuda --lengths 8192,16384,32768,65536 --reps 3 \
         --heads 4 --kv-heads 2 --dtype bfloat16
     python benchmarks/long_context.py --device cuda --check-70k
     python benchmarks/long_context.py --peak-rss --lengths 16384
Each figure is the median of `reps` interleaved repetitions after one warm-up; ratios are to plain eager.
Peak memory is CUDA's max_memory_allocated per condition (not measured on the CPU but by --peak-rss); a
condition that runs out of memory is reported as such.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

import mpsimpact
from mpsimpact.attention import register


def build(device: str, dtype: torch.dtype, layers: int, heads: int, kv_heads: int, positions: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1000, hidden_size=128 * heads, intermediate_size=512 * heads,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=positions)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def forward(model, ids, attention: str, context, keep: int = 0) -> tuple[torch.Tensor, float, float]:
    """Logits (the last `keep` positions, 0: all), seconds and peak GiB (CUDA) of one forward under
    `attention` and `context`."""
    model.config._attn_implementation = attention
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    if ids.is_cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    sync()
    start = time.perf_counter()
    with torch.inference_mode(), context():
        logits = model(ids, logits_to_keep=keep).logits
    sync()
    peak = torch.cuda.max_memory_allocated() / 2**30 if ids.is_cuda else float("nan")
    return logits, time.perf_counter() - start, peak


CONDITIONS = {
    "eager": ("eager", contextlib.nullcontext),
    "mps_safe_eager": ("mps_safe_eager", contextlib.nullcontext),
    "eager+guard chunk": ("eager", lambda: mpsimpact.guard("chunk", devices=("cpu", "cuda"))),
    "sdpa": ("sdpa", contextlib.nullcontext),
}


def _try_forward(model, ids, attention: str, context):
    """forward(), or None where the device runs out of memory (eager at 64k on one GPU)."""
    try:
        return forward(model, ids, attention, context, keep=1)
    except (torch.OutOfMemoryError, RuntimeError) as error:
        if "out of memory" not in str(error).lower():
            raise
        if ids.is_cuda:
            torch.cuda.empty_cache()
        return None


def _summary(times: list[float], base: float, peak: float, output, reference) -> dict:
    if not times:
        return {"error": "out of memory"}
    median = statistics.median(times)
    diff = float((output - reference).abs().max()) if reference is not None else float("nan")
    return {"median_s": round(median, 4), "ratio": round(median / base, 3) if base else None,
            "peak_gib": round(peak, 2), "max_abs_diff_vs_reference": diff}


def ratios(args) -> dict:
    """Per length: each condition's median seconds, ratio to eager, peak GiB and largest difference from
    eager's last-position logits (from SDPA's where eager ran out of memory)."""
    register()
    results = {}
    for length in map(int, args.lengths.split(",")):
        model = build(args.device, getattr(torch, args.dtype), 1, args.heads, args.kv_heads, length)
        ids = torch.randint(0, 1000, (1, length), device=args.device)
        times = {name: [] for name in CONDITIONS}
        peaks, outputs = {}, {}
        for rep in range(args.reps + 1):
            names = list(CONDITIONS)[rep % len(CONDITIONS):] + list(CONDITIONS)[:rep % len(CONDITIONS)]
            for name in names:
                if rep and name not in outputs:
                    continue  # ran out of memory in the warm-up
                found = _try_forward(model, ids, *CONDITIONS[name])
                if found is None:
                    continue
                logits, seconds, peak = found
                if rep:  # the first round warms up
                    times[name].append(seconds)
                peaks[name], outputs[name] = max(peak, peaks.get(name, 0.0)), logits[0, -1].float().cpu()
                del logits
        base = statistics.median(times["eager"]) if times["eager"] else None
        reference = outputs.get("eager", outputs.get("sdpa"))
        results[length] = {name: _summary(t, base, peaks.get(name, float("nan")), outputs.get(name), reference)
                           for name, t in times.items()}
        print(length, json.dumps(results[length]), flush=True)
        del model
    return results


def one_rss(args) -> dict:
    """One layer's forward under `args.one_rss` (in this fresh process): peak RSS (GiB) and seconds."""
    register()
    model = build("cpu", getattr(torch, args.dtype), 1, args.heads, args.kv_heads, args.length)
    ids = torch.randint(0, 1000, (1, args.length))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    _, seconds, _ = forward(model, ids, args.one_rss, contextlib.nullcontext, keep=1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"attention": args.one_rss, "length": args.length, "seconds": round(seconds, 2),
            "peak_rss_gib": round(peak, 3), "rss_before_forward_gib": round(before, 3)}


def peak_rss(args) -> dict:
    """--one-rss for sdpa, eager and mps_safe_eager at each length, each in its own process."""
    results = {}
    for length in map(int, args.lengths.split(",")):
        for attention in args.attentions.split(","):
            command = [sys.executable, __file__, "--one-rss", attention, "--length", str(length), "--dtype",
                       args.dtype, "--heads", str(args.heads), "--kv-heads", str(args.kv_heads)]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            found = json.loads(done.stdout.splitlines()[-1]) if done.returncode == 0 else {
                "error": (done.stderr.strip().splitlines() or ["killed"])[-1][:300]}
            results[f"{length} {attention}"] = found
            print(length, attention, json.dumps(found), flush=True)
    return results


def check_70k(args) -> dict:
    """Emulated eager is wrong; guard chunk and mps_safe_eager equal plain eager (all on the device)."""
    register()
    length, bits = args.length, args.index_bits
    model = build(args.device, torch.bfloat16, 2, 2, 1, length)
    ids = torch.randint(0, 1000, (1, length), device=args.device)
    found = {}
    plain, seconds, peak = forward(model, ids, "sdpa", contextlib.nullcontext)  # memory-light reference
    found["plain sdpa"] = {"s": seconds, "peak_gib": peak}
    plain = plain.float()
    variants = {
        "plain eager": ("eager", contextlib.nullcontext),
        "emulated eager": ("eager", lambda: mpsimpact.emulate(index_bits=bits)),
        "emulated eager + guard chunk": ("eager", lambda: _both(mpsimpact.emulate(index_bits=bits),
                                                                mpsimpact.guard("chunk", index_bits=bits))),
        "emulated mps_safe_eager": ("mps_safe_eager", lambda: mpsimpact.emulate(index_bits=bits)),
    }
    for name, (attention, context) in variants.items():
        try:
            logits, seconds, peak = forward(model, ids, attention, context)
        except (RuntimeError, mpsimpact.MpsImpactError) as error:
            found[name] = {"error": str(error).splitlines()[0][:300]}
            continue
        diff = (logits.float() - plain).abs().amax(dim=-1)[0]  # per position
        found[name] = {"s": round(seconds, 2), "peak_gib": round(peak, 2), "max_abs_diff": float(diff.max()),
                       "positions_off_by_more_than_0.05": int((diff > 0.05).sum())}
        print(name, json.dumps(found[name]), flush=True)
        del logits
    return found


@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--lengths", default="8192,16384")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--check-70k", action="store_true")
    parser.add_argument("--length", type=int, default=70_000, help="With --check-70k (smaller for a dry run).")
    parser.add_argument("--index-bits", type=int, default=32, help="With --check-70k (20 for a dry run at 1536).")
    parser.add_argument("--peak-rss", action="store_true", help="CPU: peak RSS per condition, fresh processes.")
    parser.add_argument("--attentions", default="sdpa,mps_safe_eager,eager", help="With --peak-rss.")
    parser.add_argument("--one-rss", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help="Also write the results here.")
    args = parser.parse_args()
    if args.one_rss:
        print(json.dumps(one_rss(args)))
        return
    results = check_70k(args) if args.check_70k else peak_rss(args) if args.peak_rss else ratios(args)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
