"""The matrix's models beyond BERT and the project's encoder, for LoRA targets those two do not have.

``"mha"``: a plain-PyTorch classifier whose attention is ``nn.MultiheadAttention`` (inside
``nn.TransformerEncoderLayer``, as ViT, CLIP and hand-written transformers have it). ``"moe"``: a tiny transformers 5
Mixtral classifier, whose experts are 3-D ``nn.Parameter``s (``mlp.experts.gate_up_proj``, ``down_proj``) that only
``target_parameters`` reaches.
"""

from __future__ import annotations

import torch
from torch import nn

HIDDEN, LAYERS, HEADS, FFN, LABELS = 16, 2, 2, 32, 3


class AttentionClassifier(nn.Module):
    """Token embedding, ``nn.TransformerEncoderLayer`` blocks (post-norm, batch first) and a linear head on the
    first position."""

    def __init__(self, vocab_size: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, HIDDEN)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(HIDDEN, HEADS, FFN, dropout, batch_first=True)
                                    for _ in range(LAYERS))
        self.head = nn.Linear(HIDDEN, LABELS)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids)  # (B, L, H)
        for layer in self.layers:
            hidden = layer(hidden, src_key_padding_mask=attention_mask == 0)
        return self.head(hidden[:, 0])  # (B, 3)


def mixtral(vocab_size: int, dropout: float) -> nn.Module:
    from transformers import MixtralConfig, MixtralForSequenceClassification

    config = MixtralConfig(vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=HIDDEN, num_hidden_layers=LAYERS,
                           num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=HIDDEN // HEADS,
                           num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32, num_labels=LABELS,
                           pad_token_id=0, attention_dropout=dropout)
    return MixtralForSequenceClassification(config)


def model(kind: str, vocab_size: int, dropout: float) -> nn.Module:
    """The model of ``kind`` (``"mha"`` or ``"moe"``)."""
    return AttentionClassifier(vocab_size, dropout) if kind == "mha" else mixtral(vocab_size, dropout)
