"""TensorParallelStrategy: the plan and its errors (one process), and real 2-rank runs on gloo against one process.

The multi-process checks run once (``tp_script.py``, the job ``tensor_parallel`` of ``tests/_two_ranks.py``, several
checks and fits in one process group); each rank computes its single-process reference itself and the tests compare.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn
from torch.testing import assert_close

from tests.strategies._launch import run_lm_example
from lightning_peft.nn import TransformerDecoder
from lightning_peft.peft import inject_lora
from lightning_peft.strategies import TensorParallelStrategy
from lightning_peft.parallel.dtensor import clip_grad_norm, local_parameter_bytes
from lightning_peft.parallel.tensor_parallel import auto_plan, resolve_plan



def _decoder(**kwargs) -> TransformerDecoder:
    torch.manual_seed(0)
    options = {"vocab_size": 32, "hidden_size": 16, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
               "ffn_size": 32, **kwargs}
    return TransformerDecoder(**options)


# ---------------------------------------------------------------------------------------------- the plan
def test_auto_plan_of_our_decoder_with_lora():
    decoder = _decoder()
    inject_lora(decoder, rank=2, target_modules=["q_proj", "v_proj", "down_proj"])
    plan = auto_plan(decoder)
    for i in range(2):
        for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.up_proj", "mlp.gate_proj"):
            assert plan.pop(f"layers.{i}.{name}") == "colwise"
        for name in ("attn.o_proj", "mlp.down_proj"):
            assert plan.pop(f"layers.{i}.{name}") == "rowwise"
    assert plan == {"embed_tokens": "rowwise", "lm_head": "colwise"}


def test_auto_plan_of_hugging_face_bert_and_llama(tiny_bert_config):
    from transformers import BertModel, LlamaConfig, LlamaForCausalLM

    bert = auto_plan(BertModel(tiny_bert_config))
    assert bert["encoder.layer.0.attention.self.query"] == "colwise"
    assert bert["encoder.layer.0.attention.self.value"] == "colwise"
    assert bert["encoder.layer.0.attention.output.dense"] == "rowwise"
    assert bert["encoder.layer.1.intermediate.dense"] == "colwise"
    assert bert["encoder.layer.1.output.dense"] == "rowwise"
    assert "pooler.dense" not in bert
    llama = auto_plan(LlamaForCausalLM(LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2,
    )))
    assert llama == {
        "model.embed_tokens": "rowwise", "lm_head": "colwise",
        **{f"model.layers.0.self_attn.{p}_proj": "colwise" for p in "qkv"},
        "model.layers.0.self_attn.o_proj": "rowwise",
        **{f"model.layers.0.mlp.{p}_proj": "colwise" for p in ("gate", "up")},
        "model.layers.0.mlp.down_proj": "rowwise",
    }


def test_auto_plan_leaves_tied_or_indivisible_embeddings_whole():
    assert "embed_tokens" not in auto_plan(_decoder(tie_word_embeddings=True))
    assert "lm_head" not in auto_plan(_decoder(tie_word_embeddings=True))
    plan = auto_plan(_decoder(vocab_size=33))
    assert "embed_tokens" not in plan and "lm_head" not in plan and "layers.0.attn.q_proj" in plan


def test_user_plan_patterns_name_suffixes_and_wildcards():
    plan = resolve_plan(_decoder(), {"attn.?_proj": "colwise", "layers.*.attn.o_proj": "rowwise"}, 2)
    assert plan == {**{f"layers.{i}.attn.{p}_proj": "colwise" for i in range(2) for p in "qkv"},
                    **{f"layers.{i}.attn.o_proj": "rowwise" for i in range(2)}}


def test_local_parameter_bytes_of_a_plain_model_is_its_size():
    model = nn.Linear(4, 3)
    assert local_parameter_bytes(model) == 15 * 4


def test_clip_grad_norm_equals_torch_on_plain_tensors():
    torch.manual_seed(0)
    a, b = nn.Linear(4, 3), nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    for m in (a, b):
        m(torch.randn(2, 4, generator=torch.Generator().manual_seed(1))).square().sum().backward()
    expected = torch.nn.utils.clip_grad_norm_(a.parameters(), 0.1)
    assert_close(clip_grad_norm(b.parameters(), 0.1), expected)
    for p, q in zip(a.parameters(), b.parameters()):
        assert_close(p.grad, q.grad)


def test_checkpoint_lacking_trained_parameters_is_refused(tmp_path):
    from torch.distributed.checkpoint import save

    from lightning_peft.strategies.tensor_parallel import _load_sharded

    decoder = _decoder()
    frozen = {k: v for k, v in decoder.state_dict().items()}
    save({"state_dict": frozen}, checkpoint_id=tmp_path)  # one process: no process group needed
    inject_lora(decoder, rank=2, target_modules=["q_proj"])
    with pytest.raises(RuntimeError, match=r"lacks trained parameters of the model, e.g. "
                                           r"'layers.0.attn.q_proj.lora_A.default.weight' \(6 keys missing"):
        _load_sharded(decoder, [], tmp_path, strict=True, weights_only=True)


# ---------------------------------------------------------------------------------------------- errors
def test_size_not_dividing_the_heads_is_refused():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4\): 'layers.0.attn' \(FlashAttention\) has "
                                         r"num_heads=4, num_kv_heads=2; each rank must hold whole attention heads.*"
                                         r"Choose one of \[1, 2\]"):
        resolve_plan(_decoder(), "auto", 4)


def test_size_not_dividing_the_hidden_size_is_refused():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3\): 'layers.0.attn.q_proj' \(Linear 16 -> 16\) is "
                                         r"split colwise over its 16 output features, and 3 does not divide 16"):
        resolve_plan(_decoder(vocab_size=33), "auto", 3)


def test_unrecognised_model_says_how_to_give_a_plan():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    with pytest.raises(ValueError, match=r"plan='auto'\) recognises no module of Sequential.*Give a plan, e.g. "
                                         r"TensorParallelStrategy\(plan=\{'fc1': 'colwise'.*"
                                         r"Linear modules it has: 0, 2"):
        resolve_plan(model, "auto", 2)


def test_pattern_matching_no_module_is_refused():
    with pytest.raises(ValueError, match=r"plan=\{'fc9': 'colwise'\}\) matches no module of TransformerDecoder. "
                                         r"Linear modules it has: q_proj \(x2\)"):
        resolve_plan(_decoder(), {"fc9": "colwise"}, 2)


def test_pattern_matching_a_non_linear_module_is_refused():
    with pytest.raises(ValueError, match=r"matches 'layers.0.attn' \(FlashAttention\), which is not a Linear"):
        resolve_plan(_decoder(), {"attn": "colwise"}, 2)


def test_attention_split_partly_is_refused():
    with pytest.raises(ValueError, match=r"splits q_proj of 'layers.0.attn' but not k_proj, v_proj, o_proj; shard "
                                         r"the query, key and value projections alike"):
        resolve_plan(_decoder(), {"q_proj": "colwise"}, 2)


def test_attention_output_split_alone_is_refused():
    with pytest.raises(ValueError, match=r"splits o_proj of 'layers.1.attn' but not q_proj, k_proj, v_proj"):
        resolve_plan(_decoder(), {"layers.1.attn.o_proj": "rowwise"}, 2)


def test_tied_weight_in_a_user_plan_is_refused():
    with pytest.raises(ValueError, match=r"'lm_head' shares its weight with another module \(tied embeddings\)"):
        resolve_plan(_decoder(tie_word_embeddings=True), {"lm_head": "colwise"}, 2)


def test_lora_on_an_embedding_in_the_plan_is_refused():
    decoder = _decoder()
    inject_lora(decoder, rank=2, target_modules=["embed_tokens"])
    with pytest.raises(ValueError, match=r"'embed_tokens' is a LoRAEmbedding on a Embedding; tensor parallelism "
                                         r"supports LoRA on nn.Linear layers only"):
        resolve_plan(decoder, {"embed_tokens": "rowwise"}, 2)


@pytest.mark.parametrize("plan", [{"q_proj": "diagonal"}, {"q_proj": "Colwise"}])
def test_style_other_than_colwise_or_rowwise_is_refused(plan):
    with pytest.raises(ValueError, match=r"a plan maps module name patterns to 'colwise' or 'rowwise'"):
        TensorParallelStrategy(plan=plan)


@pytest.mark.parametrize("plan", ["manual", {}, ["q_proj"]])
def test_plan_that_is_neither_auto_nor_a_dict_is_refused(plan):
    with pytest.raises(ValueError, match=r"give 'auto' or a non-empty dict"):
        TensorParallelStrategy(plan=plan)


@pytest.mark.parametrize("size", [0, -2, True, 1.5])
def test_size_must_be_a_positive_integer(size):
    error = ValueError if isinstance(size, int) and not isinstance(size, bool) else TypeError  # a bool is no size
    with pytest.raises(error, match=r"TensorParallelStrategy\(tensor_parallel_size=.*\): tensor_parallel_size must be "
                                    r"an integer >= 1"):
        TensorParallelStrategy(tensor_parallel_size=size)
    with pytest.raises(error, match=r"TensorParallelStrategy\(data_parallel_size=.*\): data_parallel_size must be an "
                                    r"integer >= 1, e.g. 'auto'"):
        TensorParallelStrategy(data_parallel_size=size)


def test_device_count_not_a_multiple_of_the_size_is_refused_before_launch():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2\): the run has 3 devices, not a multiple of 2"):
        pl.Trainer(accelerator="cpu", devices=3, strategy=TensorParallelStrategy(2), logger=False)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2, data_parallel_size=2\): their product must equal "
                                         r"the 2 devices"):
        pl.Trainer(accelerator="cpu", devices=2, strategy=TensorParallelStrategy(2, data_parallel_size=2),
                   logger=False)


def test_registry_names():
    for name in ("tensor_parallel", "tp"):
        assert name in StrategyRegistry
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=name, logger=False)
        assert isinstance(trainer.strategy, TensorParallelStrategy)
        assert trainer.strategy.tensor_parallel_size == 2 and trainer.strategy.plan == "auto"


# ---------------------------------------------------------------------------------------------- two processes
@pytest.fixture(scope="module")
def runs(two_ranks) -> Path:
    return two_ranks.path("tensor_parallel")  # tp_script.py on 2 ranks (tests/_two_ranks.py)


def _load(runs: Path, section: str, rank: int) -> dict:
    return torch.load(runs / f"{section}-rank{rank}.pt", weights_only=False)


@pytest.mark.multiprocess
@pytest.mark.parametrize("model", ["decoder", "bert", "llama"])
def test_outputs_and_gradients_equal_one_process(runs, model):
    for rank in (0, 1):
        result = _load(runs, "pure", rank)
        assert result[f"{model}_output_error"] < 1e-12  # float64
        assert result[f"{model}_grad_error"] < 1e-12 * max(1.0, result[f"{model}_grad_norm"])
        assert result[f"{model}_grad_norm"] > 1e-3  # the adapter's A and B both got real gradients


@pytest.mark.multiprocess
def test_five_optimizer_steps_with_lora_equal_one_process(runs):
    for rank in (0, 1):
        result = _load(runs, "pure", rank)
        assert result["sgd_step_error"] < 1e-5 < 1e-2 < result["sgd_moved"]
        assert result["adamw_step_error"] < 5e-5 < 1e-2 < result["adamw_moved"]


@pytest.mark.multiprocess
def test_global_norm_clipping_over_dtensor_and_plain_gradients(runs):
    result = _load(runs, "pure", 0)
    assert result["clip_norm_error"] < 1e-12
    assert result["clip_grad_error"] < 1e-12


@pytest.mark.multiprocess
def test_per_rank_parameter_bytes_about_half(runs):
    result = _load(runs, "pure", 0)
    for model in ("decoder", "bert", "llama"):
        local, whole = result[f"{model}_bytes"]
        assert 0.5 < local / whole < 0.62, (model, local, whole)  # norms, biases of row-wise layers, LoRA A or B whole
    local, whole = _load(runs, "trainer", 1)["bytes"]
    assert 0.5 < local / whole < 0.62


@pytest.mark.multiprocess
def test_lightning_fit_with_lora_callback_equals_a_plain_loop(runs):
    for rank in (0, 1):
        result = _load(runs, "trainer", rank)
        assert result["trainer_error"] < 1e-5 < 1e-2 < result["trainer_moved"]
        assert len(result["plan"]) == 16  # 7 projections x 2 layers, the embedding and the head


@pytest.mark.multiprocess
def test_data_parallel_dimension_equals_one_process_on_the_joint_batch(runs):
    for rank in (0, 1):
        result = _load(runs, "trainer", rank)
        assert result["dp_sizes"] == (2, 1)
        assert result["dp_error"] < 1e-5


@pytest.mark.multiprocess
def test_data_parallel_size_and_rank_come_from_the_mesh(runs):
    for rank in (0, 1):
        seams = _load(runs, "trainer", rank)["seams"]
        assert seams == {"dp": (2, rank), "tp": (1, 0)}  # the ranks of one tensor-parallel group read one batch


@pytest.mark.multiprocess
def test_data_parallel_replicas_routing_different_multilora_adapters_equal_one_process(runs):
    """Rank 0's batches train adapter a, rank 1's adapter b: each gradient is averaged with the other replica's zeros
    (not with the other adapter's gradient), and adapter c, which no batch uses, gets no gradient and no step."""
    for rank in (0, 1):
        result = _load(runs, "multilora", rank)
        reference, initial = result["reference"], result["initial"]
        assert result["replicas"].keys() == reference.keys() and len(reference) == 24  # 3 adapters x 2 x 2 x 2
        for name, value in result["replicas"].items():
            assert_close(value, reference[name], rtol=0, atol=1e-5, msg=name)
            moved = (reference[name] - initial[name]).abs().max()
            if ".c." in name:
                assert moved == 0, name
            else:
                assert moved > 1e-3, name


@pytest.mark.multiprocess
def test_data_parallel_resume_from_an_adapter_only_checkpoint(runs):
    keys = _load(runs, "trainer", 0)["dp_checkpoint_keys"]
    assert len(keys) == 28 and all(".lora_A." in k or ".lora_B." in k for k in keys)  # no frozen base inside
    # and the run resumed from it still equals the reference (test_data_parallel_dimension_...)


@pytest.mark.multiprocess
def test_resume_from_its_own_checkpoint_equals_a_straight_run(runs):
    for rank in (0, 1):
        assert _load(runs, "trainer", rank)["resume_error"] == 0.0
    assert sorted(p.name for p in (runs / "first" / "ckpt" / "last.ckpt").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"  # a distributed checkpoint: one file per rank
    ]


@pytest.mark.multiprocess
def test_merge_on_save_exports_the_full_adapter_on_rank_zero(runs):
    result = _load(runs, "trainer", 0)
    assert result["export_keys"] == 28  # A and B of 14 layers, full (gathered) tensors
    assert result["export_error"] < 1e-5
    assert (runs / "straight" / "export" / "merged").is_dir()


@pytest.mark.multiprocess
def test_adapter_from_a_tp_run_loads_in_peft_with_the_single_process_outputs(runs):
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    assert _load(runs, "peft", 0)["tp_vs_single"] < 1e-5
    reference = torch.load(runs / "llama_ref.pt")
    model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(runs / "llama_base"), runs / "llama_adapter")
    with torch.no_grad():
        logits = model(reference["ids"]).logits
    assert_close(logits, reference["logits"], rtol=0, atol=1e-5)
    with torch.no_grad(), model.disable_adapter():
        base = model(reference["ids"]).logits
    assert (logits - base).abs().max() > 1e-3  # the adapter acts


@pytest.mark.multiprocess
def test_example_config_runs_on_two_processes(tmp_path):
    output = run_lm_example("causal_lm_tp_bbc_news.yaml", tmp_path)
    # 7 projections x 2 layers; the tied embedding and head stay whole.
    assert "TensorParallelStrategy: 14 modules split over 2 ranks" in output and "test_ppl" in output
    last = tmp_path / "artifacts" / "causal_lm_tp_bbc" / "checkpoints" / "last.ckpt"
    assert sorted(p.name for p in last.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
