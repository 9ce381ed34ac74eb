"""The guard and mps_safe_eager at long context: one batch (one head) whose own product crosses a
limit is split along its query rows, never handed to MPS whole; decoders with grouped key/value heads
and sliding windows. Index width 20 (LIMIT 2**20, VIEW_LIMIT 2**19) under the emulator, so any piece
that still faulted would come back wrong."""

import pytest
import torch
import torch.nn.functional as F

import mpsimpact
from mpsimpact.attention import attention_blocks, mps_safe_eager_attention, register
from mpsimpact.errors import NotEmulatedError, OversizedOpError
from mpsimpact.modes.chunking import split_bmm, split_sdpa
from mpsimpact.engine.faults import TensorSpec

BITS = 20


def test_one_batch_q_kt_is_split_along_its_rows_and_equals_plain():
    # (1, 2048, 64) @ (1, 64, 1024) with K^T a transposed view: output 2,097,152 > 2**20 -> wrong_all.
    q, k = torch.randn(1, 2048, 64), torch.randn(1, 1024, 64)
    plain = torch.bmm(q, k.transpose(1, 2))
    with mpsimpact.emulate(index_bits=BITS):
        broken = torch.bmm(q, k.transpose(1, 2))
        with mpsimpact.guard("chunk", index_bits=BITS) as guard:
            got = torch.bmm(q, k.transpose(1, 2))
    assert not torch.allclose(broken, plain, atol=1e-3)  # the emulator really faults this call
    torch.testing.assert_close(got, plain)
    assert len(guard.chunked) == 1


def test_the_row_split_keeps_every_piece_below_the_limits():
    # One batch of (2048, 64) @ (64, 1024): rows per block = (2**19 - 1) // 1024 = 511.
    split = split_bmm(TensorSpec.contiguous((1, 2048, 64)), TensorSpec.contiguous((1, 64, 1024)), BITS)
    assert (split.batches, split.rows, split.cols) == (1, 511, 1024)
    # A row of a wider than the view limit cannot be split: (1, 4, 2**19) @ (1, 2**19, 4).
    assert split_bmm(TensorSpec.contiguous((1, 4, 2**19)), TensorSpec.contiguous((1, 2**19, 4)), BITS) is None


def test_a_call_no_split_makes_safe_is_refused_under_chunk_not_computed():
    a, b = torch.randn(1, 2, 2**19), torch.randn(1, 2**19, 2)  # each operand 2**20 elements
    with mpsimpact.emulate(index_bits=BITS), mpsimpact.guard("chunk", index_bits=BITS):
        with pytest.raises(OversizedOpError, match="No split makes it safe"):
            torch.bmm(a, b.transpose(1, 2).contiguous().transpose(1, 2))


def test_causal_sdpa_with_one_head_past_the_limit_is_split_along_query_rows():
    # One head of 2048 tokens: 2048 * 2048 = 4,194,304 scores > 2**20: the fused op is wrong on 2.12.1.
    q, k, v = (torch.randn(1, 1, 2048, 16) for _ in range(3))
    plain = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with mpsimpact.emulate(index_bits=BITS, profile="2.12.1"):
        with pytest.raises(NotEmulatedError):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        with mpsimpact.guard("chunk", index_bits=BITS, profile="2.12.1") as guard:
            got = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(got, plain, atol=1e-5, rtol=1e-5)
    assert len(guard.chunked) == 1
    # Blocks of 2**20 // 2048 = 512 query rows: four pieces, each 512 * 2048 = 2**20 scores.
    assert split_sdpa((1, 1, 2048, 16), (1, 1, 2048, 16), 16, BITS).block == 512


def test_sdpa_with_grouped_heads_and_a_sliding_window_mask_is_split_too():
    q = torch.randn(1, 4, 1536, 8)
    k, v = torch.randn(1, 2, 1536, 8), torch.randn(1, 2, 1536, 8)
    i = torch.arange(1536)
    window = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 512)  # causal, 512-token window
    plain = F.scaled_dot_product_attention(q, k, v, attn_mask=window, enable_gqa=True)
    with mpsimpact.emulate(index_bits=BITS, profile="2.12.1"), mpsimpact.guard("chunk", index_bits=BITS,
                                                                                 profile="2.12.1"):
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=window, enable_gqa=True)
    torch.testing.assert_close(got, plain, atol=1e-5, rtol=1e-5)


def test_attention_blocks_fold_a_group_of_query_heads_into_rows():
    # 2 query heads per key/value head, 1536 keys, head dim 8: a whole head is 2 * 1536 * 1536 rows x keys
    # = 4,718,592 > 2**19 - 1, so blocks of (2**19 - 1) // (2 * 1536) = 170 query rows.
    assert attention_blocks(1, 2, 2, 1536, 1536, 8, 8, BITS).block == 170
    assert attention_blocks(8, 2, 2, 64, 64, 8, 8, BITS).block == 64  # short: whole rows, many samples


def _decoder(kind: str):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048)
    if kind == "llama":
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    else:
        config = transformers.MistralConfig(**common, sliding_window=512)
        cls = transformers.MistralForCausalLM
    torch.manual_seed(0)
    return cls(config).eval(), config


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_mps_safe_eager_equals_eager_on_decoders_with_grouped_heads(kind):
    # Batch 1 x 1536 tokens, 4 query heads over 2 key/value heads: one head's scores 1536**2 = 2,359,296
    # > 2**20. Mistral adds a 512-token sliding window (in the mask transformers builds).
    model, _ = _decoder(kind)
    ids = torch.randint(0, 64, (1, 1536))
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        eager = model(ids).logits
        model.config._attn_implementation = register()
        # 2.14.0: on 2.13.0 the mask transformers builds ((1, 1, 1536, 1536) > 2**20) would abort first
        with mpsimpact.emulate(index_bits=BITS, profile="2.14.0") as emu:
            safe = model(ids).logits
    torch.testing.assert_close(safe, eager, atol=1e-4, rtol=1e-4)
    assert emu.records == []  # no piece crossed a limit
    assert model.model.layers[0].self_attn.config._attn_implementation == "mps_safe_eager"


def test_mps_safe_eager_with_the_cache_on_and_a_padding_mask():
    model, _ = _decoder("llama")
    ids = torch.randint(0, 64, (2, 40))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :7] = 0  # left padding
    with torch.no_grad():
        model.config._attn_implementation = "eager"
        eager = model(ids, attention_mask=mask, use_cache=True).logits
        model.config._attn_implementation = register()
        safe = model(ids, attention_mask=mask, use_cache=True).logits
    torch.testing.assert_close(safe[0], eager[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(safe[1, 7:], eager[1, 7:], atol=1e-5, rtol=1e-5)


def test_mps_safe_eager_refuses_what_no_block_makes_safe():
    q = torch.empty(1, 2, 4, 8, device="meta")
    k = torch.empty(1, 1, 2**19, 8, device="meta")  # one key head alone: 2**22 elements > 2**19
    with mpsimpact.emulate(index_bits=BITS), pytest.raises(OversizedOpError, match="shorten the sequence"):
        mps_safe_eager_attention(torch.nn.Module(), q, k, k, None)
