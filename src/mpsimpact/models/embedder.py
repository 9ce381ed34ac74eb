"""Sentence-transformers models under test: a SentenceTransformer (its own transformer, pooling and
normalisation modules) as one module from padded token ids to sentence embeddings, loaded offline
with eager attention in fp32; and, for the shape-only tracer, its transformer built on `meta`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mpsimpact.models.classifier import (LoadedModel, PooledEncoder, check_eager, check_model_folder,
                                        embedded_model_path, implementation, quiet_transformers, with_blocks)
from mpsimpact.config import EMBEDDED_MODEL
from mpsimpact.errors import ModelLoadError
from mpsimpact.prediction.meta_model import build_meta_model

EMBEDDED_SENTENCE_TRANSFORMER = f"{EMBEDDED_MODEL} (sentence-transformers)"


class SentenceEmbedder(nn.Module):
    """A SentenceTransformer run on a pre-tokenised batch: one forward through all its modules."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        features = {"input_ids": input_ids, "attention_mask": attention_mask}
        return self.model(features)["sentence_embedding"]  # (B, D)


def load_sentence_transformer(source: str | None = None) -> Any:
    """A SentenceTransformer on the CPU, fp32, eager attention, offline: the embedded
    all-MiniLM-L6-v2 (None) or a local folder / cached hub id."""
    from sentence_transformers import SentenceTransformer

    quiet_transformers()
    name = str(embedded_model_path()) if source is None else source
    if source is not None:
        check_model_folder(source)
    try:
        model = SentenceTransformer(name, device="cpu", model_kwargs={"attn_implementation": "eager"},
                                    local_files_only=True)
    except (OSError, ValueError) as error:
        raise ModelLoadError(
            f"Sentence-transformers model '{name}' could not be loaded: it is not a local path and not in "
            f"the Hugging Face cache ({type(error).__name__}). Download it once with network access, or pass "
            "a local directory.") from None
    check_eager(model[0].model, name)
    return model.eval()


def load_embedder(source: str | None = None) -> LoadedModel:
    """A SentenceTransformer wrapped for the runner (module, tokenizer, config, name)."""
    model = load_sentence_transformer(source)
    config = model[0].model.config
    name = EMBEDDED_SENTENCE_TRANSFORMER if source is None else source
    return LoadedModel(SentenceEmbedder(model).eval(), model.tokenizer, config, (), name,
                       config.max_position_embeddings)


def meta_embedder(config: Any, attention: str = "eager") -> nn.Module:
    """The SentenceTransformer's transformer built on `meta` from its config (no weights)."""
    from transformers import AutoModel

    encoder = build_meta_model(AutoModel, config, implementation(attention))
    return with_blocks(PooledEncoder(encoder).eval(), attention)
