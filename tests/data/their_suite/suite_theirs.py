"""A small suite nobody wrote for mpsimpact: batches compared with per-sample results (README, "Your own
test suite as a Mac would run it"; tests/test_pytest_plugin.py runs it)."""

import pytest
import torch
import torch.nn.functional as F


def per_sample(fn, *batched):
    return torch.cat([fn(*(x[i:i + 1].clone() for x in batched)) for i in range(batched[0].shape[0])])


def test_bmm_matches_per_sample():
    torch.manual_seed(0)
    a, b = torch.randn(8, 16, 64), torch.randn(8, 64, 4)  # a: 8192 elements, past 4096; output 512
    torch.testing.assert_close(torch.bmm(a, b), per_sample(torch.bmm, a, b))


def test_matmul_matches_per_sample():
    torch.manual_seed(1)
    a, b = torch.randn(2, 4, 16, 64), torch.randn(2, 4, 64, 4)  # folded to bmm of (8, 16, 64)
    torch.testing.assert_close(torch.matmul(a, b), per_sample(torch.matmul, a, b))


def test_small_matmul_is_untouched():
    a, b = torch.randn(2, 8, 8), torch.randn(2, 8, 8)
    torch.testing.assert_close(torch.matmul(a, b), per_sample(torch.matmul, a, b))


def test_tiny_bert_batch_matches_each_sample():
    from transformers import BertConfig, BertModel

    torch.manual_seed(2)
    config = BertConfig(vocab_size=64, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=8, max_position_embeddings=64, attn_implementation="eager",
                        initializer_range=1.0)  # scores far from uniform: a wrapped P reads other values
    model = BertModel(config).eval()
    ids = torch.randint(0, 64, (4, 32))  # P (4*2, 32, 32): 8192 elements, its P V wraps at 4096
    with torch.no_grad():
        whole = model(ids).last_hidden_state
        alone = per_sample(lambda x: model(x).last_hidden_state, ids)
    torch.testing.assert_close(whole, alone, atol=1e-5, rtol=1e-4)


def test_sdpa_math_matches_per_sample():
    torch.manual_seed(3)
    q, k, v = (torch.randn(4, 2, 32, 4, requires_grad=True) for _ in range(3))  # with grads: the math path
    out = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, per_sample(F.scaled_dot_product_attention, q, k, v))


@pytest.mark.mpsimpact("off")
def test_marked_out_is_left_alone():
    torch.manual_seed(0)
    a, b = torch.randn(8, 16, 64), torch.randn(8, 64, 4)
    torch.testing.assert_close(torch.bmm(a, b), per_sample(torch.bmm, a, b))
