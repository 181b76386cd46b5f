"""Passkey tasks drawn fresh for every training window (the long-range share of reference v2's training).

The corpus holds a few dozen needle documents with one question each, and a run sees them many times
over: a small model can learn their values by heart and still fail on a passkey it has not seen (the
needle gate measures new ones). :class:`PasskeyTasks` splices new passkeys into a share of the sampled
windows instead: ``keys`` statements at random depths of the window's own text and, at its end, up to
``max_questions`` questions, each answered. The answer tokens can weigh more in the loss, and their
positions are returned so the indexer's KL (computed on sampled queries in long windows) always sees
the queries that must reach far back.

The wording is the needle gate's own (:mod:`dsaindex.pipelines.reference.synthetic`); the values, names and
depths are new for every window, so nothing of the gate's prompts is seen in training except the form.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsaindex.pipelines.reference.synthetic import (
    passkey_answer,
    passkey_question,
    passkey_statement,
    passkeys,
)

KEY_COUNTS = (1, 2, 4, 8)


def answer_tokens(tokenizer: Any, value: str) -> list[int]:
    """The tokens of a passkey's value as they follow the question (the closing period left out)."""
    return tokenizer.encode(passkey_answer(value)).ids[:-1] or tokenizer.encode(passkey_answer(value)[:-1]).ids


@dataclass
class TaskBatch:
    """Training windows after :meth:`PasskeyTasks.apply`: ``input_ids`` and ``labels`` [B, S] int64,
    ``answer`` [B, S] bool (the labels that are answer tokens; None when no window got a task) and
    ``focus`` [n] int64 (sorted positions whose next token is an answer, over the whole batch)."""

    input_ids: Any
    labels: Any
    answer: Any = None
    focus: Any = None


class PasskeyTasks:
    """Splices fresh passkey tasks into a ``share`` of training windows.

    Parameters
    ----------
    tokenizer : path of the corpus's ``tokenizer.json``
    share : fraction of windows (0-1) that carry a task
    seed : seeds the choice of windows, names, values and depths
    key_counts : statements per task, drawn from these
    max_questions : questions at the window's end (distinct passkeys, at most the statement count)
    """

    def __init__(self, tokenizer: Path, share: float, seed: int = 0, key_counts: tuple[int, ...] = KEY_COUNTS,
                 max_questions: int = 4):
        from tokenizers import Tokenizer

        from dsaindex.errors import DsaIndexError

        if not 0.0 <= share <= 1.0:
            raise DsaIndexError(f"A passkey share of {share} is not a fraction of the windows.",
                                "pass --passkey-share between 0 and 1.")
        if max_questions < 1 or not key_counts or min(key_counts) < 1:
            raise DsaIndexError("A passkey task needs at least one statement and one question.",
                                "pass positive key counts and --passkey-questions >= 1.")
        self.tokenizer = Tokenizer.from_file(str(tokenizer))
        self.share = share
        self.key_counts = tuple(key_counts)
        self.max_questions = max_questions
        self.rng = random.Random(seed)

    def task(self, filler: list[int], length: int) -> tuple[list[int], list[int]]:
        """A sequence of exactly ``length`` tokens: ``filler``'s first tokens with passkey statements at
        random depths, then the questions and answers. Returns (tokens, indices of the answer tokens).
        Fewer statements are used when the task would take more than half of the sequence."""
        rng, tok = self.rng, self.tokenizer
        drawn = rng.choice(self.key_counts)
        for keys in sorted((k for k in self.key_counts if k <= drawn), reverse=True):
            values = passkeys(rng, keys)
            asked = rng.sample(list(values), min(keys, rng.randint(1, self.max_questions)))
            statements = [tok.encode(passkey_statement(n, v)).ids for n, v in values.items()]
            questions = [(tok.encode(passkey_question(n)).ids, answer_tokens(tok, values[n])) for n in asked]
            closing = tok.encode(".\n").ids
            size = sum(map(len, statements)) + sum(len(q) + len(a) + len(closing) for q, a in questions)
            if size <= length // 2:
                break
        else:
            return list(filler[:length]), []
        room = length - size
        text = list(filler[:room])
        cuts = sorted(rng.randrange(0, room + 1) for _ in statements)
        out, last = [], 0
        for cut, statement in zip(cuts, statements, strict=True):
            out += text[last:cut] + statement
            last = cut
        out += text[last:]
        answers = []
        for question, answer in questions:
            out += question
            answers += range(len(out), len(out) + len(answer))
            out += answer + closing
        return out, answers

    def apply(self, input_ids: Any, labels: Any) -> TaskBatch:
        """Windows laid out as :func:`~dsaindex.pipelines.reference.train.sample_windows` returns them
        (``input_ids`` = BOS + stream[:-1], ``labels`` = the stream), a share of them rewritten."""
        import torch

        b, s = input_ids.shape
        rows = [r for r in range(b) if self.rng.random() < self.share]
        if not rows:
            return TaskBatch(input_ids, labels)
        input_ids, labels = input_ids.clone(), labels.clone()
        answer = torch.zeros(b, s, dtype=torch.bool)
        stream = labels[rows].cpu()
        for j, r in enumerate(rows):
            tokens, answers = self.task(stream[j].tolist(), s)
            new = torch.tensor(tokens, dtype=torch.long)
            labels[r] = new.to(labels.device)
            input_ids[r, 1:] = new[:-1].to(input_ids.device)
            answer[r, answers] = True
        focus = answer.any(0).nonzero().flatten()  # position j's query predicts labels[j]
        return TaskBatch(input_ids, labels, answer.to(labels.device), focus.to(labels.device))
