"""The Curriculum callback under a real Trainer: the plain-loop sampler's order and weights, with LoRA; the
logged fraction; exact resume mid-schedule and at an epoch's end; self-paced scores; the sequence-length
warm-up; errors."""

from __future__ import annotations

import itertools
import types

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from lightning_peft.callbacks import Curriculum, GradientNoise, LoRA
from lightning_peft.peft import adapter_state_dict, inject_lora
from lightning_peft.callbacks._train_loader import check_resamplable
from lightning_peft.training import (
    AccumulationSchedule,
    CurriculumSampler,
    LossScorer,
    compute_scores,
    warmup_length,
)

from tests._models import LORA_ARGS, Classifier, Indexed, indexed_data, loader, token_sum, trainer


class RestoreAfterSetup(SingleDeviceStrategy):
    """Restores callbacks after configure_optimizers, as FSDP and DeepSpeed do: the loader exists by then."""

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True


class AsksForTheLoaderInSetup(RestoreAfterSetup):
    """Builds the train loader in its setup, before the restore, as DeepSpeed does to read the micro-batch size
    (``_auto_select_batch_size``); the fit loop builds its own after the restore."""

    def setup(self, trainer) -> None:
        trainer.fit_loop._data_source.dataloader()
        super().setup(trainer)


class RecordStart(Callback):
    def on_fit_start(self, trainer, pl_module):
        self.state = {k: v.clone() for k, v in adapter_state_dict(pl_module.model).items()}


class RecordFraction(Callback):
    def __init__(self) -> None:
        self.fractions: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.fractions.append(float(trainer.callback_metrics["curriculum_fraction"]))


def test_callback_under_trainer_equals_the_sampler_in_a_plain_loop_with_lora(tiny_bert_config, tmp_path):
    torch.manual_seed(0)
    module = Indexed(tiny_bert_config)
    base = {k: v.clone() for k, v in module.model.state_dict().items()}
    record = RecordStart()
    curriculum = Curriculum(duration=6, scorer=token_sum, start_fraction=0.25, seed=3)
    trainer(tmp_path, max_steps=8, callbacks=[LoRA(**LORA_ARGS), curriculum, record]).fit(
        module, DataLoader(indexed_data(), batch_size=4, shuffle=True))

    from transformers import BertForSequenceClassification

    data = indexed_data()
    scores = compute_scores(data, token_sum)
    assert torch.equal(curriculum.scores, scores)
    sampler = CurriculumSampler(scores, batch_size=4, duration=6, start_fraction=0.25, seed=3)
    model = BertForSequenceClassification(tiny_bert_config)
    model.load_state_dict(base)
    inject_lora(model, **LORA_ARGS)
    model.load_state_dict(record.state, strict=False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    model.train()
    seen = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for ids, labels, index in DataLoader(data, batch_size=4, sampler=sampler):
            seen.append(index.tolist())
            optimizer.zero_grad()
            model(input_ids=ids, labels=labels).loss.backward()
            optimizer.step()
    assert module.seen == seen
    assert set(seen[0]) <= set(sampler.order[:4])  # step 0 drew from the easiest quarter
    ours, plain = adapter_state_dict(module.model), adapter_state_dict(model)
    for key in plain:
        torch.testing.assert_close(ours[key], plain[key], rtol=1e-6, atol=1e-7)


def test_the_pool_moves_with_the_optimizer_step_under_accumulation_and_is_logged(tiny_bert_config, tmp_path):
    module = Indexed(tiny_bert_config)
    fractions = RecordFraction()
    curriculum = Curriculum(duration=3, scorer=token_sum, start_fraction=0.25)
    trainer(tmp_path, max_epochs=2, accumulate_grad_batches=3, callbacks=[curriculum, fractions]).fit(
        module, DataLoader(indexed_data(), batch_size=4))
    # 4 batches an epoch: batches 0-2 make step 0 and batch 3 step 1 (Lightning steps at an epoch's end).
    sampler = CurriculumSampler(compute_scores(indexed_data(), token_sum), batch_size=4, duration=3,
                                start_fraction=0.25, accumulate_grad_batches=3)
    expected = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        expected += [[int(i) for i in b] for b in DataLoader(range(16), batch_size=4, sampler=sampler)]
    assert module.seen == expected
    assert fractions.fractions == [sampler.pool_size(t) / 16 for t in (0, 0, 0, 1, 2, 2, 2, 3)]
    assert fractions.fractions[:4] == [0.25, 0.25, 0.25, 0.5]


def test_epochs_cut_short_keep_the_step_count_of_the_trainer(tiny_bert_config, tmp_path):
    module = Indexed(tiny_bert_config)
    curriculum = Curriculum(duration=3, scorer=token_sum, start_fraction=0.25)
    trainer(tmp_path, max_epochs=2, limit_train_batches=2, callbacks=[curriculum]).fit(
        module, DataLoader(indexed_data(), batch_size=4))
    sampler = curriculum.sampler
    assert sampler.batches_per_epoch == 2 and sampler.step(1, 0) == 2
    plain = CurriculumSampler(curriculum.scores, batch_size=4, duration=3, start_fraction=0.25,
                              batches_per_epoch=2)
    expected = []
    for epoch in range(2):
        plain.set_epoch(epoch)
        expected += [[int(i) for i in b] for b in DataLoader(range(16), batch_size=4, sampler=plain)][:2]
    assert module.seen == expected


def fit(config, tmp_path, epochs, ckpt_path=None, duration=8, estimate=False, strategy="auto"):
    torch.manual_seed(0)
    module = Indexed(config, estimate=estimate)
    curriculum = Curriculum(duration=duration, scorer="loss", start_fraction=0.25)
    callbacks = [
        LoRA(**LORA_ARGS), GradientNoise(eta=0.01), curriculum,
        ModelCheckpoint(dirpath=tmp_path / "steps", filename="{step}", every_n_train_steps=3, save_top_k=-1),
        ModelCheckpoint(dirpath=tmp_path / "epochs", filename="{epoch}", save_top_k=-1),
    ]
    run = trainer(tmp_path, max_epochs=epochs, enable_checkpointing=True, callbacks=callbacks,
                  strategy=strategy)
    run.fit(module, DataLoader(indexed_data(), batch_size=4), ckpt_path=ckpt_path)
    return module, curriculum


def test_a_resumed_run_continues_the_schedule_of_the_straight_run(tiny_bert_config, tmp_path):
    straight, straight_curriculum = fit(tiny_bert_config, tmp_path / "straight", 3)
    assert len(straight.seen) == 12
    cases = [  # (checkpoint, batches before it, the ways the loader and the checkpoint meet)
        ("steps/step=6.ckpt", 6, {}),  # mid-epoch 1; the loader is made after the restore
        ("epochs/epoch=0.ckpt", 4, {"estimate": True}),  # end of epoch 0; the loader is made in between
        # mid-epoch 0; the loader is made before the callbacks are restored
        ("steps/step=3.ckpt", 3, {"estimate": True, "strategy": RestoreAfterSetup(torch.device("cpu"))}),
        # mid-epoch 0; one loader made before the restore (DeepSpeed's), the one that trains after it
        ("steps/step=3.ckpt", 3, {"strategy": AsksForTheLoaderInSetup(torch.device("cpu"))}),
    ]
    for checkpoint, done, how in cases:
        resumed, curriculum = fit(tiny_bert_config, tmp_path / f"resumed{done}-{len(how)}", 3,
                                  ckpt_path=tmp_path / "straight" / checkpoint, **how)
        assert resumed.seen == straight.seen[done:], checkpoint
        # Self-paced scores come from the checkpoint, not from the resumed (already trained) model.
        assert torch.equal(curriculum.scores, straight_curriculum.scores)
        for key, value in adapter_state_dict(straight.model).items():
            assert torch.equal(adapter_state_dict(resumed.model)[key], value), (checkpoint, key)
    state = torch.load(tmp_path / "straight" / "steps" / "step=6.ckpt", weights_only=False)["callbacks"]
    (saved,) = [v for k, v in state.items() if k.startswith("Curriculum")]
    assert saved["position"] == {"epoch": 1, "batches": 2, "step": 6, "epoch_step": 4}


def test_self_paced_scores_are_the_losses_of_the_model_before_training(tiny_bert_config, tmp_path):
    torch.manual_seed(0)
    module = Classifier(tiny_bert_config)
    base = {k: v.clone() for k, v in module.model.state_dict().items()}
    curriculum = Curriculum(duration=4, scorer="loss")
    trainer(tmp_path, max_steps=2, callbacks=[LoRA(**LORA_ARGS), curriculum]).fit(module, loader())

    from transformers import BertForSequenceClassification

    reference = BertForSequenceClassification(tiny_bert_config)
    reference.load_state_dict(base)
    expected = compute_scores(loader().dataset, LossScorer(reference, batch_size=4))
    torch.testing.assert_close(curriculum.scores, expected, rtol=1e-5, atol=1e-6)  # LoRA starts as identity


def test_a_teacher_directory_scores_by_its_loss(tiny_bert_config, tmp_path):
    """Transfer scoring: a trained model saved with save_pretrained (as MergeOnSave's merged/) ranks the data."""
    from transformers import BertForSequenceClassification

    torch.manual_seed(5)
    teacher = BertForSequenceClassification(tiny_bert_config)
    teacher.save_pretrained(tmp_path / "teacher")
    curriculum = Curriculum(duration=4, scorer="loss", teacher=str(tmp_path / "teacher"))
    trainer(tmp_path, max_steps=2, callbacks=[LoRA(**LORA_ARGS), curriculum]).fit(Classifier(tiny_bert_config), loader())
    expected = compute_scores(loader().dataset, LossScorer(teacher, batch_size=4))
    torch.testing.assert_close(curriculum.scores, expected, rtol=1e-5, atol=1e-6)
    for directory, match in ((tmp_path, "not a Hugging Face sequence classifier directory"),
                             (tmp_path / "missing", "no such directory; give a directory written by save_pretrained")):
        module = Classifier(tiny_bert_config)
        before = {k: v.clone() for k, v in module.state_dict().items()}
        with pytest.raises(ValueError, match=rf"Curriculum\(teacher='{directory}'\): {match}"):
            trainer(tmp_path, max_steps=1, callbacks=[Curriculum(duration=4, scorer="loss", teacher=str(directory))]
                    ).fit(module, loader())
        assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())  # failed before training


def test_resuming_with_other_curriculum_settings_or_other_data_is_refused(tiny_bert_config, tmp_path):
    fit(tiny_bert_config, tmp_path / "first", 1)
    curriculum = Curriculum(duration=8, scorer="loss", start_fraction=0.25)
    callbacks = [LoRA(**LORA_ARGS), GradientNoise(eta=0.01), curriculum]
    match = (r"Curriculum: the checkpoint holds the scores of 16 samples, but the train dataset has 12; "
             r"resume with the data of the checkpoint's run")
    with pytest.raises(ValueError, match=match):
        trainer(tmp_path / "other", max_epochs=2, callbacks=callbacks).fit(
            Indexed(tiny_bert_config), DataLoader(indexed_data(12), batch_size=4),
            ckpt_path=tmp_path / "first" / "epochs" / "epoch=0.ckpt")
    match = (r"Curriculum: the checkpoint was trained with duration=8; this run has duration=9\. Resume with the "
             r"checkpoint's settings, or start a new run without ckpt_path\.")
    with pytest.raises(ValueError, match=match):
        fit(tiny_bert_config, tmp_path / "again", 2, ckpt_path=tmp_path / "first" / "epochs" / "epoch=0.ckpt",
            duration=9)


class Lengths(pl.LightningDataModule):
    """Dict batches of (B, 16) token tensors; sample i has 2 + (7 * i) % 15 real tokens (``mask_samples=False``: the
    samples have no attention mask, only padded ids); ``loader``: keyword arguments of the train DataLoader."""

    def __init__(self, mask_samples: bool = True, **loader) -> None:
        super().__init__()
        self.loader = {"batch_size": 4, **loader}
        self.items = []
        for i in range(16):
            real = 2 + (7 * i) % 15
            mask = torch.zeros(16, dtype=torch.long)
            mask[:real] = 1
            self.items.append({"input_ids": torch.arange(16) * mask, "attention_mask": mask,
                               "labels": torch.tensor(i % 2), "index": torch.tensor(i)})
            if not mask_samples:
                del self.items[-1]["attention_mask"]

    def train_dataloader(self):
        return DataLoader(self.items, **self.loader)


class Bag(pl.LightningModule):
    """Mean of token embeddings -> 2 classes; records each batch's sequence length and indices."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(16, 4), nn.Linear(4, 2)
        self.lengths: list[int] = []
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        self.lengths.append(batch["input_ids"].shape[1])
        self.seen.append(batch["index"].tolist())
        mask = batch.get("attention_mask", batch["input_ids"] > 0).unsqueeze(-1)  # (B, T, 1)
        pooled = (self.embed(batch["input_ids"]) * mask).sum(1) / mask.sum(1)  # (B, 4)
        return nn.functional.cross_entropy(self.head(pooled), batch["labels"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_length_scores_and_the_sequence_length_warmup_on_dict_batches_from_a_datamodule(tmp_path):
    module, data = Bag(), Lengths()
    curriculum = Curriculum(duration=4, scorer="length", start_fraction=0.25, length_warmup_steps=4,
                            min_length=4, max_length=16)
    run = trainer(tmp_path, max_epochs=2, callbacks=[curriculum])
    run.fit(module, datamodule=data)
    assert module.lengths == [warmup_length(t, 4, 16, 4) for t in range(8)] == [4, 4, 4, 12, 16, 16, 16, 16]
    lengths = [int(item["attention_mask"].sum()) for item in data.items]
    assert curriculum.scores.tolist() == lengths
    shortest = sorted(range(16), key=lambda i: (lengths[i], i))[:4]
    assert set(module.seen[0]) <= set(shortest)
    assert run.callback_metrics["sequence_length"] == 16.0
    assert "dataloader" not in vars(run.fit_loop._data_source)  # teardown put Lightning's own method back


def test_the_warmup_needs_dict_batches(tiny_bert_config, tmp_path):
    curriculum = Curriculum(duration=4, scorer=token_sum, length_warmup_steps=4)
    with pytest.raises(TypeError, match=r"Curriculum\(length_warmup_steps=4\): the batch is a list; the "
                                        r"sequence-length warm-up needs dict batches of \(B, T\) tensors"):
        trainer(tmp_path, max_steps=1, callbacks=[curriculum]).fit(
            Indexed(tiny_bert_config), DataLoader(indexed_data(), batch_size=4))


def test_the_length_scorer_needs_token_ids(tiny_bert_config, tmp_path):
    run = trainer(tmp_path, max_steps=1, callbacks=[Curriculum(duration=4)])
    with pytest.raises(TypeError, match=r"LengthScorer\(key='input_ids'\): a sample of type tuple has no "):
        run.fit(Classifier(tiny_bert_config), loader())


@pytest.mark.parametrize(("train", "error", "match"), [
    (lambda: [loader(), loader()], TypeError,
     (r"Curriculum: the train dataloader is a list; it must be one torch DataLoader \(not a list or dict of "
      r"them")),
    (lambda: DataLoader(loader().dataset, batch_sampler=BatchSampler(SequentialSampler(range(16)), 4, False)),
     TypeError, (r"Curriculum: the train DataLoader has a custom batch_sampler \(BatchSampler\) and "
                 r"batch_size=None; it must have a map-style dataset and a batch_size")),
])
def test_loaders_whose_sampler_cannot_be_replaced_are_refused(tiny_bert_config, tmp_path, train, error,
                                                                match):
    with pytest.raises(error, match=match):
        trainer(tmp_path, max_steps=1, callbacks=[Curriculum(duration=4, scorer=token_sum)]).fit(
            Classifier(tiny_bert_config), train())


def test_a_sampler_of_its_own_is_refused_before_training_and_shuffle_is_not(tmp_path):
    """The curriculum sampler replaces the loader's: a subset or weights the user's sampler chose would be lost
    silently, so such a sampler is refused at setup, named; shuffle= samplers, a plain DistributedSampler and the
    data modules' EpochShuffleSampler (all only order the whole dataset) are replaced."""
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

    from lightning_peft.data import EpochShuffleSampler

    module, data = Bag(), Lengths(sampler=SubsetRandomSampler([0, 1, 2, 3]))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    fix = (r"To train on part of the data, give the DataLoader torch\.utils\.data\.Subset\(dataset, indices\) as its "
           r"dataset; else drop sampler= \(shuffle=True or False is fine: the curriculum owns the order\)")
    with pytest.raises(TypeError, match=r"Curriculum: the train DataLoader has a sampler of its own "
                                        r"\(SubsetRandomSampler\), which the curriculum sampler would replace.*" + fix):
        trainer(tmp_path, max_steps=2, callbacks=[Curriculum(duration=100, start_fraction=1.0)]).fit(
            module, datamodule=data)
    assert module.seen == [] and all(torch.equal(v, before[k]) for k, v in module.state_dict().items())
    items = data.items
    for sampler, name in [
        (WeightedRandomSampler([1.0] * 16, 16), "WeightedRandomSampler"),
        (RandomSampler(items, replacement=True), r"RandomSampler\(replacement=True, num_samples=None\)"),
        (RandomSampler(items, num_samples=4), r"RandomSampler\(replacement=False, num_samples=4\)"),
        (SequentialSampler(range(4)), "SequentialSampler over another data source than the DataLoader's dataset"),
        (DistributedSamplerWrapper(SubsetRandomSampler([0, 1]), num_replicas=1, rank=0),
         "DistributedSamplerWrapper"),
        (EpochShuffleSampler(4, seed=0), "EpochShuffleSampler of 4 samples for a dataset of 16"),
    ]:
        with pytest.raises(TypeError, match=rf"Curriculum: the train DataLoader has a sampler of its own \({name}"):
            check_resamplable(DataLoader(items, batch_size=4, sampler=sampler), "Curriculum")
    for accepted in (DataLoader(items, batch_size=4, shuffle=True), DataLoader(items, batch_size=4, shuffle=False),
                   DataLoader(items, batch_size=4, sampler=DistributedSampler(items, num_replicas=2, rank=1)),
                   DataLoader(items, batch_size=4, sampler=EpochShuffleSampler(16, seed=0))):  # the data modules
        assert check_resamplable(accepted, "Curriculum") is accepted
    module = Bag()  # a shuffled loader trains under the curriculum, drawing from the whole data once admitted
    trainer(tmp_path, max_epochs=1, callbacks=[Curriculum(duration=1, start_fraction=0.25)]).fit(
        module, datamodule=Lengths(shuffle=True))
    shortest = sorted(range(16), key=lambda i: int(data.items[i]["attention_mask"].sum()))[:4]
    assert len(module.seen) == 4 and set(module.seen[0]) <= set(shortest)


def constant(sample) -> float:
    return 1.0


def test_scores_that_are_all_the_same_are_refused_before_training(tmp_path):
    """Padded samples without an attention mask all have the padded length: no easy-to-hard order, so the
    curriculum would admit a random share while logging its fraction. Refused after scoring, before a step."""
    for scorer, fix in (("length", r"give the samples an attention_mask \(without one, LengthScorer counts padding"),
                        (constant, r"check the scorer: it gave every sample the same value")):
        module = Bag()
        name = scorer if isinstance(scorer, str) else "tests.callbacks.test_curriculum.constant"
        with pytest.raises(ValueError, match=rf"Curriculum\(scorer='{name}'\): all 16 samples have the same score "
                                             rf"\((16|1)\.0\), so there is no easy-to-hard order.*; {fix}"):
            trainer(tmp_path, max_steps=1, callbacks=[Curriculum(duration=4, scorer=scorer)]).fit(
                module, datamodule=Lengths(mask_samples=False))
        assert module.seen == []
    # With start_fraction=1 every step admits all the data, so no order is used (a sequence-length warm-up alone).
    module = Bag()
    trainer(tmp_path, max_steps=1, callbacks=[Curriculum(duration=4, start_fraction=1.0)]).fit(
        module, datamodule=Lengths(mask_samples=False))
    assert len(module.seen) == 1


def test_a_trainer_without_the_loader_request_it_wraps_is_reported(tiny_bert_config, tmp_path):
    run = trainer(tmp_path, max_steps=1, callbacks=[Curriculum(duration=4, scorer=token_sum)])
    run.fit_loop._data_source = types.SimpleNamespace()  # as if a future Lightning had renamed it
    with pytest.raises(RuntimeError, match=r"Curriculum: this Lightning version \(2\.\d+\.\d+\S*\) has no "
                                           r"trainer\.fit_loop\._data_source\.dataloader, through which the "
                                           r"callback replaces the train sampler"):
        run.fit(Indexed(tiny_bert_config), DataLoader(indexed_data(), batch_size=4))


def test_a_dotted_path_names_the_scorer():
    curriculum = Curriculum(duration=4, scorer="tests._models.token_sum")
    assert curriculum.scoring_function is token_sum
    assert Curriculum(duration=4, scorer=token_sum).scorer == "tests._models.token_sum"


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"pacing": "cosine"}, ValueError,
     r"Curriculum\(pacing='cosine'\): pacing must be one of 'linear', 'root', 'step', 'exponential'"),
    ({"start_fraction": 0.0}, ValueError,
     r"Curriculum\(start_fraction=0\.0\): start_fraction must be a finite number in \(0, 1\]"),
    ({"duration": 0}, ValueError, r"Curriculum\(duration=0\): duration must be an integer >= 1"),
    ({"stairs": 1.5}, TypeError, r"Curriculum\(stairs=1\.5\): stairs must be an integer >= 1"),
    ({"seed": -1}, ValueError, r"Curriculum\(seed=-1\): seed must be an integer >= 0"),
    ({"seed": "0"}, TypeError, r"Curriculum\(seed='0'\): seed must be an integer >= 0"),
    ({"length_warmup_steps": -1}, ValueError,
     r"Curriculum\(length_warmup_steps=-1\): length_warmup_steps must be an integer >= 0 \(0 turns the warm-up off\)"),
    ({"length_warmup_steps": 2.0}, TypeError,
     r"Curriculum\(length_warmup_steps=2\.0\): length_warmup_steps must be an integer >= 0"),
    ({"length_warmup_steps": 4, "min_length": 64, "max_length": 32}, ValueError,
     r"Curriculum\(min_length=64, max_length=32\): min_length must be <= max_length"),
    ({"scorer": "no_such_module.score"}, ValueError,
     (r"Curriculum\(scorer='no_such_module\.score'\): cannot import it \(ModuleNotFoundError: No module "
      r"named 'no_such_module'\); use 'length', 'loss', or the dotted path of a function sample -> float")),
    ({"scorer": "lenght"}, ValueError,
     r"Curriculum\(scorer='lenght'\): not 'length' or 'loss', nor the dotted path"),
    ({"scorer": "math.pi"}, ValueError,
     r"Curriculum\(scorer='math\.pi'\): not 'length' or 'loss', nor the dotted path of a function"),
    ({"scorer": "length", "teacher": "."}, ValueError,
     r"Curriculum\(scorer='length', teacher='\.'\): a teacher scores by its loss; set scorer='loss'"),
    ({"scorer": 3}, TypeError,
     r"Curriculum\(scorer=3\): scorer must be 'length', 'loss', a function sample -> float"),
])
def test_bad_settings_fail_when_the_callback_is_made(kwargs, error, match):
    with pytest.raises(error, match=match):
        Curriculum(**{"duration": 4, **kwargs})


class RecordWindows(Callback):
    """How many micro-batches the module had trained at each optimizer step: the windows of each step."""

    def __init__(self) -> None:
        self.ends: list[int] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.ends.append(len(pl_module.seen))


def test_a_changing_accumulation_schedule_draws_each_optimizer_steps_micro_batches_from_its_pool(tmp_path):
    """GradientAccumulation(schedule={0: 1, 2: 3, 5: 2}) beside the curriculum, changing mid-epoch in both epochs:
    the micro-batches of every optimizer step (as the optimizer saw them) are exactly what a plain loop over a
    CurriculumSampler with that AccumulationSchedule draws, and all come from that step's pool."""
    from lightning_peft.callbacks import GradientAccumulation

    schedule = {0: 1, 2: 3, 5: 2}
    module, windows, curriculum = Bag(), RecordWindows(), Curriculum(duration=6, start_fraction=0.25)
    trainer(tmp_path, max_epochs=2, callbacks=[GradientAccumulation(schedule=schedule), curriculum, windows]).fit(
        module, datamodule=Lengths(batch_size=2))
    bounds = [0, *windows.ends]
    steps = [module.seen[a:b] for a, b in itertools.pairwise(bounds)]  # the micro-batches of each optimizer step
    assert [len(batches) for batches in steps] == [1, 1, 3, 3, 3, 2, 2, 1]  # Lightning steps at an epoch's end
    assert bounds[-1] == len(module.seen) == 16
    lengths = [int(item["attention_mask"].sum()) for item in Lengths().items]
    plain = CurriculumSampler(lengths, batch_size=2, duration=6, start_fraction=0.25,
                              accumulate_grad_batches=AccumulationSchedule(schedule))
    expected = []
    for epoch in range(2):
        plain.set_epoch(epoch)
        expected += [batch["index"].tolist() for batch in DataLoader(Lengths().items, batch_size=2, sampler=plain)]
    assert module.seen == expected
    pools = [plain.pool_size(step) for step in range(len(steps))]
    assert pools == [4, 6, 8, 10, 12, 14, 16, 16]
    for step, batches in enumerate(steps):
        assert {i for batch in batches for i in batch} <= set(plain.order[: pools[step]]), step
    once = CurriculumSampler(lengths, batch_size=2, duration=6, start_fraction=0.25)  # paced as if a count of 1
    assert [b.tolist() for b in DataLoader(range(16), batch_size=2, sampler=once)] != expected[:8]


def test_lightnings_epoch_keyed_accumulation_scheduler_is_refused_with_the_replacement(tiny_bert_config, tmp_path):
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    run = trainer(tmp_path, max_steps=1, callbacks=[Curriculum(duration=4), GradientAccumulationScheduler({0: 1, 1: 2})])
    with pytest.raises(ValueError, match=r"Curriculum: GradientAccumulationScheduler\(scheduling=\{0: 1, 1: 2\}\).*"
                                         r"GradientAccumulation\(schedule=\{step: count\}\)"):
        run.fit(Indexed(tiny_bert_config), DataLoader(indexed_data(), batch_size=2))


def test_self_paced_scoring_is_refused_under_a_strategy_that_splits_the_layers():
    from lightning_peft.callbacks.curriculum import _check_scoring
    from lightning_peft.strategies import PipelineStrategy

    run = types.SimpleNamespace(strategy=PipelineStrategy(num_stages=2, num_microbatches=2))
    with pytest.raises(RuntimeError, match=r"Curriculum\(scorer='loss'\) under PipelineStrategy: self-paced scoring "
                                           r"runs the whole model.*Score with a teacher"):
        _check_scoring(Curriculum(duration=4, scorer="loss"), run)
    _check_scoring(Curriculum(duration=4, scorer="length"), run)  # no model needed: accepted


def test_the_teacher_used_is_named_and_an_undertrained_one_warned_of(tiny_bert_config, tmp_path, caplog):
    """A teacher that MergeOnSave exported after 2 steps (the example's pitfall: a short `make demo`) is used with a
    warning naming its steps; one without a training record is only named."""
    import logging

    from lightning_peft.callbacks import MergeOnSave

    torch.manual_seed(0)
    trainer(tmp_path, max_steps=2, callbacks=[LoRA(**LORA_ARGS), MergeOnSave(dirpath=str(tmp_path / "demo"))]).fit(
        Classifier(tiny_bert_config), loader())
    record = (tmp_path / "demo" / "merged" / "lightning_peft_training.json").read_text()
    assert '"optimizer_steps": 2' in record and '"planned_steps": 2' in record
    curriculum = Curriculum(duration=4, scorer="loss", teacher=str(tmp_path / "demo" / "merged"))
    with pytest.warns(UserWarning, match=r"the teacher trained for 2 optimizer steps of the 2 its run planned; an "
                                         r"undertrained teacher ranks the data close to an untrained model"):
        trainer(tmp_path, max_steps=1, callbacks=[LoRA(**LORA_ARGS), curriculum]).fit(Classifier(tiny_bert_config),
                                                                                        loader())
    from transformers import BertForSequenceClassification

    BertForSequenceClassification(tiny_bert_config).save_pretrained(tmp_path / "plain")
    with caplog.at_level(logging.INFO):
        trainer(tmp_path, max_steps=1, callbacks=[LoRA(**LORA_ARGS), Curriculum(
            duration=4, scorer="loss", teacher=str(tmp_path / "plain"))]).fit(Classifier(tiny_bert_config), loader())
    assert "no training record: not written by MergeOnSave" in caplog.text
