"""HFCausalLM's packed batches through `PACKED_SDPA` (row-by-row attention registered with transformers): no (T, T)
mask and no attention call over the whole pack; logits and gradients equal each row run alone through transformers'
eager attention (float64, 1e-10) on the families' own settings: grouped key/value heads (Llama), a sliding window
shorter than the rows (Mistral), sliding and full layers (Qwen2), Gemma 3's query scale and alternating layers;
padded batches and other implementations on transformers' own path; the refusal of a packed call it cannot run.
(Gemma 2's soft-cap: transformers refuses sdpa for it, so it runs ``attn_implementation="eager"``, transformers' path.)"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.testing import assert_close

from lightning_peft.modules import HFCausalLM
from lightning_peft.modules.hf_packed import PACKED_SDPA, packed_forward
from tests._models import llama_config

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

LENGTHS = [5, 11, 2, 9]  # rows longer and shorter than the sliding windows below
SMALL = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 32,
         "initializer_range": 0.3}


def _families() -> dict:
    return {
        "llama": lambda: llama_config(initializer_range=0.3),
        "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=4),
        "qwen2": lambda: transformers.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=4,
                                                  max_window_layers=1),
        "gemma3": lambda: transformers.Gemma3TextConfig(**SMALL, sliding_window=3, query_pre_attn_scalar=5,
                                                        layer_types=["sliding_attention", "full_attention"]),
    }


class SDPACalls(TorchFunctionMode):
    """The query length and mask shape of every SDPA call (an observer: every call runs as it would)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, tuple | None]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            self.calls.append((args[0].shape[-2], None if mask is None else tuple(mask.shape)))
        return func(*args, **kwargs)


def _packed_batch(vocab: int) -> dict:
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (1, sum(LENGTHS)))
    position_ids = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return {"input_ids": ids, "position_ids": position_ids, "cu_seqlens": cu_seqlens, "max_seqlen": max(LENGTHS)}


def _rows_alone(logits, batch: dict) -> torch.Tensor:
    """``logits(ids (1, l))`` of each packed row run alone, concatenated: (1, T, V)."""
    ids = batch["input_ids"]
    return torch.cat([logits(ids[:, a:b]) for a, b in itertools.pairwise(batch["cu_seqlens"].tolist())], dim=1)


def _saved(config, tmp_path) -> str:
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gemma3"])
def test_packed_logits_and_gradients_equal_each_row_alone(family, tmp_path):
    directory = _saved(_families()[family](), tmp_path)
    module = HFCausalLM(directory, torch_dtype="float64")
    batch = _packed_batch(module.model.config.vocab_size)
    with SDPACalls() as seen:
        packed = module(**batch)  # (1, T, V)
    packed.square().sum().backward()
    grads = {n: p.grad for n, p in module.model.named_parameters()}
    # never the whole pack in one attention call, never a (T, T) mask: one call per group of rows of similar length
    assert seen.calls and all(length <= max(LENGTHS) for length, _ in seen.calls), seen.calls
    assert module.model.config._attn_implementation == PACKED_SDPA

    # transformers' sdpa on each row alone (its eager attention takes the softmax in float32)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64,
                                                               attn_implementation="sdpa")
    alone = _rows_alone(lambda ids: oracle(input_ids=ids, use_cache=False).logits, batch)
    alone.square().sum().backward()
    assert_close(packed, alone, rtol=1e-10, atol=1e-10)
    # Gemma's RMSNorm runs in float32 whatever the dtype: its weights' gradients sum float32 terms over the tokens,
    # in another order packed than row by row
    rtol = 1e-5 if family == "gemma3" else 1e-9
    for name, parameter in oracle.named_parameters():
        assert_close(grads[name], parameter.grad, rtol=rtol, atol=1e-10, msg=lambda m, name=name: f"{name}: {m}")


def test_a_packed_call_over_two_rows_is_refused(tmp_path):
    module = HFCausalLM(_saved(_families()["llama"](), tmp_path), torch_dtype="float64")
    batch = _packed_batch(module.model.config.vocab_size)
    cu_seqlens = batch["cu_seqlens"]
    with pytest.raises(ValueError, match=rf"{PACKED_SDPA} on LlamaAttention: packed rows \(cu_seq_lens_q\) need one "
                                         r"\(1, T\) row .*got query \(2, 2, 27, 8\).*attn_implementation='sdpa'"), \
            packed_forward():
        module.model(input_ids=batch["input_ids"].repeat(2, 1), position_ids=batch["position_ids"].repeat(2, 1),
                     cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, use_cache=False)


def test_padded_batches_and_other_implementations_keep_transformers_path(tmp_path):
    """A padded batch through `PACKED_SDPA` equals transformers' sdpa; ``attn_implementation="eager"`` stays eager
    and takes a packed batch through transformers' block-diagonal mask."""
    directory = _saved(_families()["mistral"](), tmp_path)
    module = HFCausalLM(directory, torch_dtype="float64")
    sdpa = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64, attn_implementation="sdpa")
    torch.manual_seed(2)
    ids = torch.randint(0, 64, (2, 9))
    mask = torch.tensor([[1] * 9, [0] * 3 + [1] * 6])
    assert_close(module(ids, attention_mask=mask), sdpa(input_ids=ids, attention_mask=mask, use_cache=False).logits,
                 rtol=1e-10, atol=1e-10)
    eager = HFCausalLM(directory, torch_dtype="float64", attn_implementation="eager")
    assert eager.model.config._attn_implementation == "eager"
    batch = _packed_batch(64)
    with SDPACalls() as seen:
        packed = eager(**batch)
    alone = _rows_alone(eager, batch)
    assert not seen.calls
    assert_close(packed, alone, rtol=1e-5, atol=1e-6)  # eager's softmax runs in float32


def test_a_process_that_never_registered_the_name_registers_it_at_the_first_call(tmp_path):
    """As a model unpickled by ``ddp_spawn`` finds it: the name in the config, not in transformers' interfaces."""
    module = HFCausalLM(_saved(_families()["llama"](), tmp_path), torch_dtype="float64")
    batch = _packed_batch(module.model.config.vocab_size)
    expected = module(**batch)
    for interface in (transformers.AttentionInterface, transformers.AttentionMaskInterface):
        del interface._global_mapping[PACKED_SDPA]
    assert_close(module(**batch), expected, rtol=0, atol=0)
    assert PACKED_SDPA in transformers.AttentionInterface._global_mapping
