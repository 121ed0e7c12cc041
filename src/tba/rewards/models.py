"""Reward models and classifiers: Hugging Face sequence-classification models read at the last
token of a text.

`RewardModel` is a reward function `fn(prompts, completions, **columns) -> list[float]`: the
model's score of each `prompt + completion + EOS`, read at that final EOS token, where reward
models of this kind are trained to score; for a conversation (TRL's format), of the prompt's and
the completion's messages rendered by the reward tokenizer's chat template. `classifier_logits`
is the batched forward pass it shares with the red-teaming classifier.

Models load the first time they score, in the process that calls them (`tba.lazy_models.Lazy`): each
searcher loads its own copy and nothing big travels with the task. Where the model's files are is
settled when the reward is made, in the process that makes the task (`reward_model_files`): a
name that is no directory and no model on the Hub is one line at once, not a reward that fails
in every searcher, and every process loads the same files.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from tba.core import Prompt
from tba.errors import ConfigError
from tba.lazy_models import Lazy
from tba.policy.model import resolve_device
from tba.policy.sources import hub_snapshot, looks_like_a_path


class RewardModel:
    """A reward function scoring each `prompt + completion + EOS` with a reward model; `key`
    names the setting that gave `name_or_path`, in the error when no such model is found."""

    def __init__(
        self,
        name_or_path: str,
        *,
        device: str = "auto",
        batch_size: int = 32,
        tokenizer_fallback: str | None = None,
        name: str = "reward_model",
        key: str = "task.reward_funcs",
    ) -> None:
        self.name_or_path = name_or_path
        self.device = device
        self.batch_size = batch_size
        self.__name__ = name  # the key of this reward in a sample's reward parts
        files = reward_model_files(name_or_path, key)
        self.model = Lazy(partial(load_reward_model, files, device, tokenizer_fallback))

    def __call__(self, prompts: list[Prompt], completions: list, **_: object) -> list[float]:
        tokenizer = self.model.get()[1]
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
        tokenizer = self.model.get()[1]
        return self.score([_ending_with_eos(p + r, tokenizer) for p, r in zip(prompts, responses)])

    def score(self, texts: list[str]) -> list[float]:
        """Scores of whole texts, read at their last token (padding excluded)."""
        model, tokenizer = self.model.get()
        return classifier_logits(model, tokenizer, texts, self.batch_size)[:, 0].float().tolist()


def reward_model_files(name_or_path: str, key: str = "task.reward_funcs") -> str:
    """The local directory of the reward model `name_or_path`: the directory itself, or the
    snapshot of a Hub id in the Hub cache (downloaded once; `HF_HUB_OFFLINE=1`: the cache only).
    A name that is neither is a `ConfigError` naming `key`, what was looked for and why it
    failed."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return str(path)
    strings = "a string there names a sequence-classification reward model (directory or Hub id)"
    if key.endswith("reward_funcs"):
        strings += ", or a reward function as `module:function` (a module or a .py file)"
    if path.exists() or looks_like_a_path(name_or_path):
        what = "a file, not a model directory" if path.exists() else "no such directory"
        raise ConfigError(f"{key}: {name_or_path!r} is {what}; {strings}")
    try:
        return str(hub_snapshot(name_or_path, key))
    except FileNotFoundError as error:  # not in the cache, not on the Hub, no network
        raise ConfigError(f"{str(error).rstrip('.')}; {strings}") from None


def _ending_with_eos(text: str, tokenizer: Any) -> str:
    """`text` ending with exactly one EOS, where the reward model's score is read."""
    eos = tokenizer.eos_token or ""
    return text.removesuffix(eos) + eos


@torch.no_grad()
def classifier_logits(
    model: Any, tokenizer: Any, texts: list[str], batch_size: int
) -> torch.Tensor:
    """The classification head on the last real token of each text, (N, num_labels), computed
    `batch_size` texts at a time (long texts keep their end, where the head reads)."""
    logits = []
    for first in range(0, len(texts), batch_size):
        batch = tokenizer(
            texts[first : first + batch_size], return_tensors="pt", padding=True,
            truncation=tokenizer.model_max_length < 1_000_000,
        ).to(model.device)  # fmt: skip
        logits.append(last_token_logits(model, batch))
    if not logits:
        return torch.zeros((0, model.config.num_labels))
    return torch.cat(logits)


def last_token_logits(model: Any, batch: Any) -> torch.Tensor:
    """The sequence-classification head on each text's last real token, (N, num_labels). Read
    from the attention mask rather than from the pad id, which is often the EOS id and would hide
    the EOS the score belongs to."""
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
    model = AutoModelForSequenceClassification.from_pretrained(
        name_or_path, dtype=dtype, use_kernels=False
    )
    model.config.pad_token_id = tokenizer.pad_token_id
    return model.to(target).eval().requires_grad_(False), tokenizer
