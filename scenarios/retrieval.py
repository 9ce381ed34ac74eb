"""Scenario `retrieval`: semantic search with sentence-transformers. The corpus is embedded on the
device in one oversized eager batch; queries (a disjoint, fixed set) and the reference index on the
CPU. What corrupted vectors do to self-retrieval, query results and hubs."""

from __future__ import annotations

from typing import Any

import torch

from mpsimpact.runs.embed_kind import EmbedKind
from mpsimpact.runs.scenario import Scenario, register

QUERIES = 256


@register
class RetrievalScenario(Scenario):
    """Embedded default: all-MiniLM-L6-v2 loaded with `SentenceTransformer` (its own pooling and
    normalisation); corpus: the embedded tweets' held-out split; queries: the first 256 texts of its
    training split (never in the corpus). `model` may be any local sentence-transformers folder."""

    name = "retrieval"
    description = "Semantic search (sentence-transformers MiniLM): the corpus embedded in one oversized eager batch."
    default_batch_size = 2048
    default_max_length = 512
    kind = EmbedKind()

    def __init__(self, model: str | None = None, dataset: str | None = None) -> None:
        from mpsimpact.errors import UsageError

        if dataset is not None:
            raise UsageError("run retrieval embeds the embedded tweet corpus; --dataset is not supported.")
        super().__init__(model=model)
        self.queries: tuple[str, ...] = ()

    def load(self) -> None:
        from mpsimpact.models.dataset import load_embedded
        from mpsimpact.models.embedder import load_embedder

        self.model = load_embedder(self.model_name)
        self.data = load_embedded("heldout")
        self.queries = load_embedded("train").texts[:QUERIES]

    def meta_module(self, config: Any | None = None, attention: str = "eager") -> torch.nn.Module:
        """The SentenceTransformer's transformer on `meta` (embedder.meta_embedder)."""
        from mpsimpact.models.embedder import meta_embedder

        return meta_embedder(config if config is not None else self.model.config, attention)
