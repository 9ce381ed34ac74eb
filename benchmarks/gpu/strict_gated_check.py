"""On a GPU (issue 35): the gated strict guard with CUDA's real byte count (Note [Strict, gated]).

- a small forward (8 x 128, the embedded classifier) leaves no dispatch mode pushed and gives the plain logits;
- at 20 index bits (8 x 128: P 1,572,864 elements past LIMIT, every activation below DIM_MAX) the first
  product past the limit starts the watch, and every record equals strict's when
  it watches from the start (CUDA's count removed for that run);
- full scale, 32 bits: a CUDA tensor of 2**31 + 64 bytes made before the guard makes it watch from its entry;
  a factory of 2**31 + 64 elements inside it is a sighting; the elementwise op on it (2.9.1 raises past
  INT_MAX) is stopped in both cases, and the guard leaves the stack as it found it.
Prints one line per check and exits 1 if any fails.
"""

from __future__ import annotations

import sys

import torch

from mpsimpact.errors import OversizedOpError
from mpsimpact.models.classifier import load_embedded_classifier
from mpsimpact.modes import guard_mode
from mpsimpact.modes.guard import guard

failures = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}")
    if not ok:
        failures.append(name)


def main() -> None:
    module = load_embedded_classifier().module.to("cuda")
    ids = torch.randint(1000, 20000, (8, 128), device="cuda")
    mask = torch.ones_like(ids)
    depths = []
    hook = module.register_forward_pre_hook(lambda m, a: depths.append(torch._C._len_torch_dispatch_stack()))
    with torch.inference_mode():
        plain = module(ids, mask)
        with guard("raise", devices=("cuda",), strict=True) as g:
            got = module(ids, mask)
            small_watched = g.watching
    hook.remove()
    check("small forward: no dispatch mode, plain logits", depths == [0, 0] and not small_watched
          and torch.equal(got, plain), f"depths {depths}, held {guard_mode.HELD_BYTES['cuda']() / 2**20:.0f} MiB")

    with torch.inference_mode():
        with guard("chunk", index_bits=20, devices=("cuda",), strict=True) as gated:
            got = module(ids, mask)
            watched = gated.watching
        counter = guard_mode.HELD_BYTES.pop("cuda")
        try:
            with guard("chunk", index_bits=20, devices=("cuda",), strict=True) as always:
                module(ids, mask)
        finally:
            guard_mode.HELD_BYTES["cuda"] = counter
    same = [(r.op, r.fault.rule) for r in gated.chunked] == [(r.op, r.fault.rule) for r in always.chunked]
    check("20 bits: watched from the first big product, records as strict's", watched and same
          and len(gated.chunked) > 0, f"{len(gated.chunked)} chunked; max |diff| "
          f"{(got - plain).abs().max().item():.2e}")

    n = 2**31 + 64
    early = torch.ones(n, dtype=torch.uint8, device="cuda")
    try:
        with guard("raise", devices=("cuda",), strict=True, profile="2.9.1") as g:
            entered_watching = g.watching
            early * 2
        stopped = False
    except OversizedOpError:
        stopped = True
    check("32 bits: 2 GiB held on entry -> watched, elementwise stopped", entered_watching and stopped)
    del early
    torch.cuda.empty_cache()
    try:
        with guard("raise", devices=("cuda",), strict=True, profile="2.9.1") as g:
            before = g.watching
            try:
                big = torch.ones(n, dtype=torch.uint8, device="cuda")  # judged itself once watched (2.9.1 may stop it)
            finally:
                after = g.watching
            big * 2
        stopped = False
    except OversizedOpError:
        stopped = True
    check("32 bits: a factory of 2**31 + 64 elements is a sighting, elementwise stopped",
          not before and after and stopped)
    check("the stack as found", torch._C._len_torch_dispatch_stack() == 0)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
