"""A RoBERTa-base-sized sequence classifier with RANDOM weights, of the published demo's shape
(12 layers, 12 heads, hidden 768), saved with the embedded MiniLM's WordPiece tokenizer: shows the
pipeline holds at that size. Its predictions mean nothing."""

import sys

from transformers import AutoTokenizer, RobertaConfig, RobertaForSequenceClassification

from mpsimpact.models.classifier import embedded_model_path

out = sys.argv[1]
tokenizer = AutoTokenizer.from_pretrained(embedded_model_path())
config = RobertaConfig(
    vocab_size=tokenizer.vocab_size, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
    intermediate_size=3072, max_position_embeddings=514, pad_token_id=tokenizer.pad_token_id, num_labels=3,
    id2label={0: "negative", 1: "neutral", 2: "positive"}, label2id={"negative": 0, "neutral": 1, "positive": 2},
)
RobertaForSequenceClassification(config).save_pretrained(out)
tokenizer.save_pretrained(out)
print("random RoBERTa-base-shaped classifier saved to", out)
