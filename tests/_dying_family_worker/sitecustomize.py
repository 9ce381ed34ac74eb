"""Planted in a family-cell worker by tests/test_sweep.py (on PYTHONPATH): the fp16 multiply of the
elementwise 1-D cell aborts the process, as MPS's MPSNDArray assertion does."""

import os
import sys

import torch

_real_mul = torch.Tensor.__mul__


def _dying_mul(self, other):
    if self.dtype == torch.float16 and self.dim() == 1 and self.numel() > 1 << 16:
        print("planted abort in elementwise-1d", file=sys.stderr, flush=True)
        os.abort()
    return _real_mul(self, other)


torch.Tensor.__mul__ = _dying_mul
