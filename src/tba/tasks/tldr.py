"""Preference tuning on TL;DR summaries: the reward is a reward model's score of prompt + summary.

A summary cut off at the length limit (no EOS) gets `train.truncation_penalty` (−1 by default)
instead of a score, through the searcher's `train.truncated` rule. Held-out metrics
(`tba.tasks.preference`, through `with_preference_metrics`): the win rate of the policy's greedy
summary against the row's reference summary under the evaluation reward model (the "gold" one,
`task.eval_reward_model`, else the training reward model), the gold and the training reward
models' mean scores, and the KL to the reference policy (the run's starting `policy.model`) and
its perplexity on the policy's sampled summaries.

Reward models are Hugging Face sequence-classification models with one output. A response is
scored as `prompt + response + EOS`, read at that final EOS token, where reward models of this
kind are trained to score. They are loaded by name or local path the first time they score, in
the process that calls them: each searcher loads its own copy and nothing big travels with the
task.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tba.tasks import Prompt, Task

PROMPT_TEMPLATE = "{query}"
ANSWER_FIELD = "reference_response"


class RewardModel:
    """A reward function `fn(prompts, completions, **columns) -> list[float]`: the reward model's
    score of each `prompt + completion + EOS`, or, for a conversation (TRL's format), of the
    prompt's and the completion's messages rendered by the reward tokenizer's chat template."""

    def __init__(
        self,
        name_or_path: str,
        *,
        device: str = "auto",
        batch_size: int = 32,
        tokenizer_fallback: str | None = None,
        name: str = "reward_model",
    ) -> None:
        self.name_or_path = name_or_path
        self.device = device
        self.batch_size = batch_size
        self.tokenizer_fallback = tokenizer_fallback
        self.__name__ = name  # the key of this reward in a sample's reward parts
        self._model: Any = None
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        """Pickled without the loaded model: a searcher process loads its own."""
        return self.__dict__ | {"_model": None, "_tokenizer": None, "_lock": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__ |= state | {"_lock": threading.Lock()}

    def __call__(self, prompts: list[Prompt], completions: list, **_: object) -> list[float]:
        tokenizer = self._load()[1]
        texts = []
        for prompt, completion in zip(prompts, completions, strict=True):
            if isinstance(prompt, str):
                texts.append(_ending_with_eos(prompt + completion, tokenizer))
            elif not tokenizer.chat_template:
                raise ValueError(f"the reward model {self.name_or_path!r} has no chat template "
                                 "to render conversational prompts with")  # fmt: skip
            else:
                chat = tokenizer.apply_chat_template(prompt + completion, tokenize=False)
                # `score` tokenizes with the special tokens: a BOS the template wrote would double.
                texts.append(chat.removeprefix(tokenizer.bos_token or ""))
        return self.score(texts)

    def score_pairs(self, prompts: list[str], responses: list[str]) -> list[float]:
        """Scores of `prompt + response`, each ending with exactly one EOS."""
        tokenizer = self._load()[1]
        return self.score([_ending_with_eos(p + r, tokenizer) for p, r in zip(prompts, responses)])

    def score(self, texts: list[str]) -> list[float]:
        """Scores of whole texts, read at their last token (padding excluded)."""
        import torch

        model, tokenizer = self._load()
        scores: list[float] = []
        for first in range(0, len(texts), self.batch_size):
            batch = tokenizer(
                texts[first : first + self.batch_size], return_tensors="pt", padding=True,
                truncation=tokenizer.model_max_length < 1_000_000,
            ).to(model.device)  # fmt: skip
            with torch.no_grad():
                scores += _last_token_scores(model, batch).float().tolist()
        return scores

    def _load(self) -> tuple[Any, Any]:
        with self._lock:  # a call that timed out may still be loading: load once
            if self._model is None:
                self._model, self._tokenizer = load_reward_model(
                    self.name_or_path, self.device, self.tokenizer_fallback
                )
        return self._model, self._tokenizer


def _ending_with_eos(text: str, tokenizer: Any) -> str:
    """`text` ending with exactly one EOS, where the reward model's score is read."""
    eos = tokenizer.eos_token or ""
    return text.removesuffix(eos) + eos


def _last_token_scores(model: Any, batch: Any) -> Any:
    """The reward model's one output on each text."""
    return last_token_logits(model, batch)[:, 0]


def last_token_logits(model: Any, batch: Any) -> Any:
    """The sequence-classification head on each text's last real token, (N, num_labels). Read
    from the attention mask rather than from the pad id, which is often the EOS id and would hide
    the EOS the score belongs to."""
    import torch

    head = getattr(model, "score", None)  # the head of Llama, Qwen, GPT-NeoX, GPT-2, ... models
    if head is None:  # BERT-like models pool their own first token
        return model(**batch).logits
    mask = batch["attention_mask"]
    hidden = model.base_model(input_ids=batch["input_ids"], attention_mask=mask).last_hidden_state
    last = mask.sum(dim=1) - 1  # right padding
    return head(hidden[torch.arange(len(last), device=last.device), last])


def load_reward_model(
    name_or_path: str, device: str, tokenizer_fallback: str | None = None
) -> tuple[Any, Any]:
    """The model (eval mode, bf16 on a GPU) and its tokenizer, padding on the right and
    truncating on the left. A model saved without a tokenizer uses `tokenizer_fallback`'s (e.g.
    the policy's, of the same family)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from tba.policy.model import resolve_device

    target = resolve_device(device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError):
        if tokenizer_fallback is None:
            raise
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_fallback)
    tokenizer.padding_side = "right"
    tokenizer.truncation_side = "left"  # keep the end, where the score is read
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    dtype = torch.bfloat16 if target.type == "cuda" else torch.float32
    model = AutoModelForSequenceClassification.from_pretrained(name_or_path, dtype=dtype)
    model.config.pad_token_id = tokenizer.pad_token_id
    return model.to(target).eval().requires_grad_(False), tokenizer


class WinRate:
    """Correctness for TL;DR: 1.0 when the judge scores the completion above the row's reference
    summary, else 0.0 (a tie loses). Reference scores are computed once and kept."""

    def __init__(self, judge: RewardModel) -> None:
        self.__name__ = "win_rate"
        self.judge = judge
        self._reference_scores: dict[tuple[str, str], float] = {}

    def __getstate__(self) -> dict:
        return self.__dict__ | {"_reference_scores": {}}

    def __call__(
        self, prompts: list[str], completions: list[str], reference: list[str], **_: object
    ) -> list[float]:
        pairs = list(zip(prompts, reference))
        missing = sorted(set(pairs) - set(self._reference_scores))
        if missing:
            scores = self.judge.score_pairs([p for p, _ in missing], [r for _, r in missing])
            self._reference_scores |= dict(zip(missing, scores))
        ours = self.judge.score_pairs(prompts, completions)
        return [float(o > self._reference_scores[pair]) for o, pair in zip(ours, pairs)]


def with_preference_metrics(task: Task, reference_policy: str | None) -> Task:
    """The TL;DR task of `tba.tasks.build` evaluated by win rate, scores, KL and perplexity
    (`tba.tasks.preference`) instead of pass@1. `reference_policy`: a directory or Hub id (the
    run's starting policy); None leaves the KL and the perplexity out."""
    from tba.tasks.preference import PreferenceEvaluator

    (reward,), win_rate = task.reward_fns, task.correct_fn
    assert isinstance(win_rate, WinRate)  # as `tba.tasks.build` makes the tldr task
    task.evaluate = PreferenceEvaluator(
        task.eval_rows, win_rate.judge.score_pairs, reward.score_pairs, reference_policy
    )
    task.metrics = ("eval_win_rate", "eval_kl") if reference_policy else ("eval_win_rate",)
    return task
