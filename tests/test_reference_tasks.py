"""Passkey tasks spliced into training windows (reference v2's long-range training)."""

from __future__ import annotations

import re

import pytest
import torch

from dsaindex.errors import DsaIndexError
from dsaindex.indexer import set_index_topk
from dsaindex.pipelines.capture.models import REFERENCE_DIR
from dsaindex.pipelines.capture.tokens import sample_windows
from dsaindex.pipelines.reference.forward import build_model, training_forward
from dsaindex.pipelines.reference.tasks import PasskeyTasks
from dsaindex.pipelines.reference.train import ReferenceTrainOptions, train_reference

TOKENIZER = REFERENCE_DIR / "tokenizer.json"
STATEMENT = re.compile(r"The passkey for (\w+) is (\d+)\. Remember it\.")
QUESTION = re.compile(r"Answer: the passkey for (\w+) is")


def _decode(tasks: PasskeyTasks, ids: list[int]) -> str:
    return tasks.tokenizer.decode(ids)


def test_a_task_fills_the_window_and_its_answers_are_the_stated_values():
    tasks = PasskeyTasks(TOKENIZER, share=1.0, seed=3)
    filler = tasks.tokenizer.encode("It is a truth universally acknowledged, that a single man " * 60).ids
    seen_values = set()
    for _ in range(12):
        tokens, answers = tasks.task(filler, 512)
        assert len(tokens) == 512
        text = _decode(tasks, tokens)
        stated = dict(STATEMENT.findall(text))
        asked = QUESTION.findall(text)
        assert stated and asked and set(asked) <= set(stated)
        assert len(asked) <= 4 and len(set(asked)) == len(asked)
        # the answer tokens, in order, spell the asked passkeys' values
        answered = _decode(tasks, [tokens[i] for i in answers]).split()
        assert answered == [stated[name] for name in asked]
        seen_values |= set(stated.values())
        # every statement comes before the first question
        assert text.rfind("Remember it.") < text.find("Question:")
    assert len(seen_values) > 30  # values are drawn fresh, not a fixed set


def test_a_window_too_short_for_any_task_stays_filler():
    tasks = PasskeyTasks(TOKENIZER, share=1.0, seed=0, key_counts=(8,))
    filler = list(range(100, 140))
    tokens, answers = tasks.task(filler, 40)
    assert tokens == filler and answers == []


def test_apply_keeps_the_window_layout_and_marks_answers_and_their_queries():
    stream = torch.randint(10, 8000, (20_000,))
    ids, labels = sample_windows(stream, 6, 700, torch.Generator().manual_seed(0), bos=0)
    batch = PasskeyTasks(TOKENIZER, share=1.0, seed=1).apply(ids, labels)
    assert torch.equal(batch.input_ids[:, 1:], batch.labels[:, :-1])
    assert bool((batch.input_ids[:, 0] == 0).all())
    assert not torch.equal(batch.labels, labels)
    assert batch.answer.shape == labels.shape and int(batch.answer.sum()) >= 6
    assert torch.equal(batch.focus, batch.answer.any(0).nonzero().flatten())
    untouched = PasskeyTasks(TOKENIZER, share=0.0).apply(ids, labels)
    assert untouched.answer is None and torch.equal(untouched.labels, labels)


def test_training_forward_reports_the_answer_loss_and_weights_it():
    from dsaindex.pipelines.capture.presets import TINY_REFERENCE_CONFIG, reference_config

    config = reference_config(TINY_REFERENCE_CONFIG, index_topk=16, vocab_size=8192)
    model = build_model(config, seed=0).eval()
    set_index_topk(model, 256)  # the transformers forward below attends densely, as training_forward's dense mode
    stream = torch.randint(10, 8000, (5_000,))
    ids, labels = sample_windows(stream, 2, 256, torch.Generator().manual_seed(0), bos=0)
    batch = PasskeyTasks(TOKENIZER, share=1.0, seed=2).apply(ids, labels)
    plain = training_forward(model, batch.input_ids, batch.labels, "dense", answer=batch.answer)
    assert torch.allclose(plain.objective, plain.lm)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, use_cache=False).logits.float()
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), reduction="none")
    assert torch.allclose(plain.task, ce[batch.answer.flatten()].mean(), atol=1e-4)
    heavy = training_forward(model, batch.input_ids, batch.labels, "dense", answer=batch.answer, answer_weight=50.0)
    assert torch.allclose(heavy.lm, plain.lm)
    # a heavier weight moves the objective toward the answer tokens' loss
    assert abs(float(heavy.objective - plain.task)) < abs(float(plain.objective - plain.task))


def test_bad_settings_are_refused():
    with pytest.raises(DsaIndexError, match="share"):
        PasskeyTasks(TOKENIZER, share=1.5)
    with pytest.raises(DsaIndexError, match="corpus"):
        train_reference(ReferenceTrainOptions(passkey_share=0.5, tiny=True), log=lambda _: None)
