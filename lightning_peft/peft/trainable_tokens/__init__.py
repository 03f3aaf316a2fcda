"""Trainable tokens: train only chosen rows of an embedding (newly added chat or special tokens), as Hugging Face
PEFT's ``TrainableTokens`` method (``peft.tuners.trainable_tokens``), which LoRA takes as ``trainable_token_indices``.

After ``tokenizer.add_special_tokens(...)`` and ``model.resize_token_embeddings(...)`` the new rows of the input
embedding are untrained; training the whole (V, d) matrix for k new tokens would train (and keep optimizer state for)
V * d values. This trains the k rows only.

Update rule, for token ids ``idx`` (k,) and trained rows ``delta`` (k, d), initialised to ``E[idx]`` (so a new adapter
starts equal to the base model):

```text
E'[i] = delta[j]   if i == idx[j]          (the rows are replaced, not added to, as in PEFT: a row drawn at random by
E'[i] = E[i]       otherwise                a resize means nothing, so the trained row must not depend on it)
embedding:  y = E'[x]                       x: ids (...), y: (..., d)
tied head:  logits = h @ E'^T               h: (..., d), logits: (..., V); the same delta
```

Only ``delta`` trains; the base matrix stays frozen and is never copied in the forward: the k rows (or logit columns)
are computed and put in place of the base output's, so a 128k-token vocabulary costs no (V, d) temporary (PEFT's
``index_copy`` of the whole weight does). The values are exactly PEFT's.

Names, as PEFT's in memory (``TrainableTokensWrapper`` around a ``TrainableTokensLayer``) and in its files:

| where | name |
| --- | --- |
| modules | ``<emb>``: a `TrainableTokensWrapper`; ``<emb>.token_adapter``: the `TrainableTokensLayer`; ``<emb>.token_adapter.base_layer``: the embedding |
| parameters | ``<emb>.token_adapter.trainable_tokens_delta.<adapter>`` (k, d); ``trainable_tokens_original.<adapter>`` (buffers outside the state dict): the rows the base held before a merge |
| PEFT's file | ``base_model.model.<emb>.token_adapter.trainable_tokens_delta``; a tied head has no key of its own |

Tied weights: when a Hugging Face model ties its output head to its input embedding (``config.tie_word_embeddings``;
the head's weight is the embedding's ``Parameter``), the head is wrapped too and follows the embedding's rows, as
PEFT's tied adapter does: its logits of the chosen tokens use the trained rows, and a merge writes the rows once into
the shared weight. A weight shared in any other way is refused: PEFT would give the two modules different rows.

Merging writes the rows into the base weight (and keeps the replaced ones, to write back on unmerge).
"""

from .config import Indices, check_indices
from .layer import TrainableTokensLayer, TrainableTokensWrapper
from .model import (
    delete_tokens,
    merge_tokens,
    merged_token_state,
    select_tokens,
    token_parameters,
    token_wrappers,
    unload_tokens,
    unmerge_tokens,
    wrap_tokens,
)

__all__ = [
    "Indices",
    "TrainableTokensLayer",
    "TrainableTokensWrapper",
    "check_indices",
    "delete_tokens",
    "merge_tokens",
    "merged_token_state",
    "select_tokens",
    "token_parameters",
    "token_wrappers",
    "unload_tokens",
    "unmerge_tokens",
    "wrap_tokens",
]
