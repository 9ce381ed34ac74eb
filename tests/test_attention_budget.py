"""mps_safe_eager within a memory budget (issue 36): pieces hold at most the budget's scores, key blocks
with an online softmax where one row of scores would not fit, values equal to transformers' eager
attention; still exact where emulated eager goes wrong (index width 20)."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import mpsimpact
from mpsimpact.attention import _blocks_of, lazy_mask, mps_safe_eager_attention
from mpsimpact.modes import budget
from mpsimpact.modes.chunking import Blocks, attention_blocks
from mpsimpact.modes import guard_entry as guard_module  # where a split SDPA is run
from mpsimpact.modes.chunking import SdpaSplit, split_sdpa
from mpsimpact.variables import ATTENTION_BUDGET

BITS = 20


@pytest.fixture(autouse=True)
def _default_budget(monkeypatch):
    monkeypatch.delenv(ATTENTION_BUDGET, raising=False)
    yield
    budget.set_memory_budget(None)


class _Module(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups


def _eager(module, q, k, v, mask, scaling):
    from transformers.models.llama.modeling_llama import eager_attention_forward

    return eager_attention_forward(module, q, k, v, mask, scaling)[0]  # (B, L, H, Dv)


def _mask(kind: str, batch: int, length: int, dtype: torch.dtype) -> torch.Tensor | None:
    """An additive mask as transformers' eager mask: 0 where attended, finfo.min elsewhere."""
    if kind == "none":
        return None
    i = torch.arange(length)
    keep = i[None, :] <= i[:, None]  # causal
    if kind == "sliding":
        keep &= i[:, None] - i[None, :] < 24
    keep = keep.expand(batch, 1, length, length).clone()
    if kind == "padding":
        keep[1:, :, :, :5] = False  # left padding of the second text
        keep[1:, :, :5, 0] = True  # padded rows see one key, as transformers keeps them finite
    zero = torch.zeros((), dtype=dtype)
    return torch.where(keep, zero, torch.finfo(dtype).min)


def test_the_budget_comes_from_the_setting_then_the_environment_then_the_device(monkeypatch):
    assert budget.memory_budget("cpu") == 256 * 2**20
    assert budget.memory_budget("meta") is None  # shapes only: unbounded
    monkeypatch.setenv(ATTENTION_BUDGET, "64M")
    assert budget.memory_budget("cpu") == 64 * 2**20
    budget.set_memory_budget(4096)
    assert budget.memory_budget("cpu") == 4096
    monkeypatch.setenv(ATTENTION_BUDGET, "lots")
    budget.set_memory_budget(None)
    with pytest.raises(ValueError, match="not a byte count"):
        budget.memory_budget("cpu")
    with pytest.raises(ValueError, match=">= 1 byte"):
        budget.set_memory_budget(0)
    # float32: the masked scores and the mask rows (4 + 4), the float32 softmax (4), probabilities (4)
    assert budget.bytes_per_score(torch.float32) == 16 and budget.bytes_per_score(torch.bfloat16) == 10


def test_attention_blocks_shrink_to_the_budget_and_never_grow_past_the_limits():
    # 8 samples x 2 kv heads, G = 2, 64 tokens: one kv head's rows hold 2 * 64 * 64 = 8192 scores.
    assert attention_blocks(8, 2, 2, 64, 64, 8, 8, BITS, scores=3 * 8192) == Blocks(3, 64)
    # Less than one head: blocks of 4096 // (2 * 64) = 32 query rows, whole rows of keys.
    assert attention_blocks(8, 2, 2, 64, 64, 8, 8, BITS, scores=4096) == Blocks(1, 32)
    # Not one query row of the group (2 * 64 scores): key blocks, isqrt(50 // 2) = 5 query rows x
    # 50 // (2 * 5) = 5 keys.
    assert attention_blocks(8, 2, 2, 64, 64, 8, 8, BITS, scores=50) == Blocks(1, 5, 5)
    # A budget above the limits changes nothing: the limit's 170 query rows (test_long_context).
    assert attention_blocks(1, 2, 2, 1536, 1536, 8, 8, BITS, scores=2**40) == Blocks(1, 170)


class _Largest(TorchDispatchMode):
    """The most elements any op made (allocations of the output itself and views left out)."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        skip = func._schema.name in ("aten::empty.memory_format", "aten::new_empty") or func.is_view
        if isinstance(out, torch.Tensor) and not skip and not func._schema.is_mutable:
            self.most = max(self.most, out.numel())
        return out


@pytest.mark.parametrize("scores", [4096, 200])
def test_no_op_in_a_piece_makes_more_than_the_budget(scores):
    # (2, 4, 128, 16) queries over 2 kv heads: eager's scores 2 * 4 * 128 * 128 = 131,072 elements.
    q, k, v = torch.randn(2, 4, 128, 16), torch.randn(2, 2, 128, 16), torch.randn(2, 2, 128, 16)
    budget.set_memory_budget(scores * budget.bytes_per_score(torch.float32))
    # 4096: blocks of 4096 // (2 * 128) = 16 query rows; 200 < 2 * 128: key blocks, isqrt(100) = 10 query
    # rows x 200 // (2 * 10) = 10 keys.
    assert _blocks_of(q, k, v) == (Blocks(1, 16) if scores == 4096 else Blocks(1, 10, 10))
    additive = _mask("causal", 2, 128, torch.float32)
    with _Largest() as largest:
        mps_safe_eager_attention(_Module(2).eval(), q, k, v, additive)
    # The scores of a piece are the largest thing it makes, but for the online softmax's accumulator
    # (G*r, Dv) = 2 * 10 * 16 = 320 in float32, which the budget does not count (at real sizes, Dv = 128
    # against thousands of keys a block, it is a few percent of the scores).
    assert largest.most == (scores if scores == 4096 else 320)


@pytest.mark.parametrize("mask", ["none", "causal", "sliding", "padding"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1.6e-2)])
def test_online_softmax_equals_eager_with_grouped_heads_and_masks(mask, dtype, tol):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 96, 32, dtype=dtype)
    k, v = torch.randn(2, 2, 96, 32, dtype=dtype), torch.randn(2, 2, 96, 32, dtype=dtype)
    additive = _mask(mask, 2, 96, dtype)
    module = _Module(2).eval()
    eager = _eager(module, q, k, v, additive, 32**-0.5)
    budget.set_memory_budget(150 * budget.bytes_per_score(dtype))  # isqrt(75) = 8 query rows x 9 keys
    assert _blocks_of(q, k, v) == Blocks(1, 8, 9)
    got, _ = mps_safe_eager_attention(module, q, k, v, additive)
    # fp32: the online softmax's rounding (~1e-6 relative); bf16: one rounding of the output (2**-7 = 7.8e-3
    # relative) plus eager's own rounding of the probabilities to bf16 before P V.
    torch.testing.assert_close(got, eager, atol=tol, rtol=tol)
    budget.set_memory_budget(None)  # the default fits: the whole-row path, bitwise eager's
    assert _blocks_of(q, k, v).key_block is None
    assert torch.equal(mps_safe_eager_attention(module, q, k, v, additive)[0], eager)


def test_with_key_blocks_it_is_still_exact_where_emulated_eager_is_wrong():
    # One head of 1152 tokens: 1152 * 1152 = 1,327,104 scores > 2**20, so eager's Q K^T faults.
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1, 1152, 16) for _ in range(3))
    additive = _mask("causal", 1, 1152, torch.float32)
    module = _Module(1).eval()
    plain = _eager(module, q, k, v, additive, 0.25)
    with mpsimpact.emulate(index_bits=BITS, profile="2.14.0"):
        broken = _eager(module, q, k, v, additive, 0.25)
    assert not torch.allclose(broken, plain, atol=1e-3)  # the emulator really faults eager
    budget.set_memory_budget(1000 * budget.bytes_per_score(torch.float32))  # < one query row of 1152 keys
    with mpsimpact.emulate(index_bits=BITS, profile="2.14.0") as emu:
        assert _blocks_of(q, k, v).key_block is not None
        got, _ = mps_safe_eager_attention(module, q, k, v, additive, scaling=0.25)
    assert emu.records == []  # no piece crossed a limit
    torch.testing.assert_close(got, plain, atol=2e-6, rtol=2e-6)


def test_the_guards_sdpa_split_shrinks_to_the_budget_with_the_same_values(monkeypatch):
    # Limits alone: blocks of 2**20 // 2048 = 512 query rows (test_long_context); a budget of 100,000
    # scores: 100,000 // 2048 = 48 query rows a piece.
    assert split_sdpa((1, 1, 2048, 16), (1, 1, 2048, 16), 16, BITS, scores=100_000) == SdpaSplit(1, 48)
    # Whole heads that fit the limits, fewer of them: 8 heads of 64 x 64, 3 heads' scores a piece.
    assert split_sdpa((2, 4, 64, 8), (2, 4, 64, 8), 8, BITS, scores=3 * 64 * 64) == SdpaSplit(3, 64)
    q = torch.randn(1, 4, 1536, 8)
    k, v = torch.randn(1, 2, 1536, 8), torch.randn(1, 2, 1536, 8)
    plain = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    budget.set_memory_budget(50_000 * budget.bytes_per_score(torch.float32))  # 50,000 // 1536 = 32 rows
    splits = []
    run = guard_module.run_sdpa_chunked
    monkeypatch.setattr(guard_module, "run_sdpa_chunked", lambda *a: splits.append(a[3]) or run(*a))
    with mpsimpact.emulate(index_bits=BITS, profile="2.12.1"), mpsimpact.guard("chunk", index_bits=BITS,
                                                                                 profile="2.12.1") as guard:
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert len(guard.chunked) == 1 and splits == [SdpaSplit(1, 32)]
    torch.testing.assert_close(got, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_decoders_with_the_lazy_mask_and_key_blocks_equal_eager(kind, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from mpsimpact import attention

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    config = (transformers.LlamaConfig(**common) if kind == "llama"
              else transformers.MistralConfig(**common, sliding_window=40))
    torch.manual_seed(0)
    model = (transformers.LlamaForCausalLM if kind == "llama" else transformers.MistralForCausalLM)(config).eval()
    ids = torch.randint(0, 64, (2, 120))
    padding = torch.ones(2, 120, dtype=torch.long)
    padding[1, :9] = 0  # left padding
    monkeypatch.setattr(lazy_mask, "LAZY_FROM", 1)  # lazy at any size (2 * 120 * 120 is below the default)
    masks = []
    piece = attention._online_piece
    monkeypatch.setattr(attention, "_online_piece", lambda *a, **k: masks.append(type(a[4])) or piece(*a, **k))
    with torch.no_grad():
        model.config._attn_implementation = "eager"
        eager = model(ids, attention_mask=padding).logits
        model.config._attn_implementation = attention.register()
        budget.set_memory_budget(200 * budget.bytes_per_score(torch.float32))  # G * 120 keys > 200: key blocks
        safe = model(ids, attention_mask=padding).logits
    assert set(masks) == {attention.LazyEagerMask}  # no whole (B, 1, L, L) mask was made
    torch.testing.assert_close(safe[0], eager[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(safe[1, 9:], eager[1, 9:], atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # benchmarks/long_context.py --peak-rss in two fresh processes at 16k tokens: about 35 s
def test_cpu_peak_rss_at_16k_tokens_one_layer_within_half_a_gib_of_sdpa(tmp_path):
    # benchmarks/long_context.py --peak-rss: each condition's forward in a fresh process, its ru_maxrss.
    # Measured here (2 cores, float32, 2 query / 1 key/value head of 128): sdpa 0.714 GiB, mps_safe_eager
    # 0.717, eager 5.53; about 25 s for the two conditions this test runs.
    import json
    import pathlib
    import subprocess
    import sys

    pytest.importorskip("transformers")
    script = pathlib.Path(__file__).parents[1] / "benchmarks" / "long_context.py"
    out = tmp_path / "rss.json"
    subprocess.run([sys.executable, str(script), "--peak-rss", "--lengths", "16384", "--attentions",
                    "sdpa,mps_safe_eager", "--json", str(out)], check=True, capture_output=True, timeout=600)
    found = json.loads(out.read_text())
    sdpa, safe = (found[f"16384 {a}"]["peak_rss_gib"] for a in ("sdpa", "mps_safe_eager"))
    assert safe <= sdpa + 0.5, found
