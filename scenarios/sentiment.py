"""Scenario `sentiment`: a 3-class tweet sentiment classifier, one oversized eager-attention
batch; the published downstream demo (docs/fault-model.md, "The published downstream demo") on an
embedded default model."""

from __future__ import annotations

from typing import Any

import torch

from mpsimpact.runs.classify_kind import ClassifyKind
from mpsimpact.runs.scenario import Scenario, register


@register
class SentimentScenario(Scenario):
    """Embedded default: all-MiniLM-L6-v2 (12 heads) + a shipped logistic-regression head, on the
    held-out CrowdFlower tweets. `model` may be any sequence-classification id or path, and
    `dataset` "tweet_eval" or a local CSV/JSON file with text and label columns."""

    name = "sentiment"
    description = "Tweet sentiment (MiniLM + linear head, or any HF classifier): one oversized eager batch."
    default_batch_size = 2048
    default_max_length = 512
    kind = ClassifyKind()

    @property
    def is_embedded(self) -> bool:
        return self.model_name is None

    def load(self) -> None:
        from mpsimpact.models.classifier import load_embedded_classifier, load_hub_classifier
        from mpsimpact.models.dataset import load_texts

        self.model = load_embedded_classifier() if self.is_embedded else load_hub_classifier(self.model_name)
        self.data = load_texts(self.dataset_name, self.model.label_names)

    def meta_module(self, config: Any | None = None, attention: str = "eager") -> torch.nn.Module:
        """The classifier built on `meta` with an attention implementation, for the shape-only tracer."""
        from mpsimpact.models.classifier import meta_classifier

        return meta_classifier(config if config is not None else self.model.config, self.is_embedded, attention)
