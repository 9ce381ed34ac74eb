"""Tiny Hugging Face models built in-process for offline tests (random weights)."""

import torch
from transformers import BertConfig, BertModel


def tiny_bert_config(**overrides):
    # hidden 16 over 4 heads: head dim 4; P per text = 4 * L * L.
    fields = dict(
        vocab_size=100,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=32,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        # Large init so attention is peaked: near-uniform P would hide which row a wrap reads.
        initializer_range=0.5,
    )
    fields.update(overrides)
    return BertConfig(**fields)


def tiny_bert(device="cpu", **overrides):
    with torch.device(device):
        model = BertModel._from_config(tiny_bert_config(**overrides), attn_implementation="eager")
    return model.eval()


def token_batch(batch, length, vocab=100, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (batch, length), generator=generator)
