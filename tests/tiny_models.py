"""Tiny random Hugging Face models of real architectures (Llama, GPT-2, Qwen2), each with a
tokenizer trained here on the embedded task's text: what the tests load instead of Hub models."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from tba.policy.sft import sft_loss
from tba.tasks.math import world as math_world

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)



def task_texts(count: int = 300) -> tuple[list[str], list[str]]:
    """Prompts and short answers (`#### n`) of the embedded task."""
    problems = math_world.problems("train", count, seed=0)
    return [math_world.format_prompt(p.question) for p in problems], [
        f"#### {p.answer}" for p in problems
    ]


def train_tokenizer(arch: str) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on the task's text, with each family's special tokens: Llama has
    BOS, EOS and pad; GPT-2 only `<|endoftext|>` (no pad token, as released); Qwen2 a chat
    template whose turns end with its EOS, `<|im_end|>`."""
    specials = {
        "llama": {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"},
        "gpt2": {"eos_token": "<|endoftext|>"},
        "qwen2": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    }[arch]
    extra = ["<|im_start|>"] if arch == "qwen2" else []
    prompts, answers = task_texts()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=[*specials.values(), *extra], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tokenizer.train_from_iterator(prompts + answers, trainer)
    if arch == "llama":  # BOS before every text, as Llama's tokenizer does
        bos = specials["bos_token"]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tokenizer.token_to_id(bos))]
        )
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, additional_special_tokens=extra, **specials
    )
    if arch == "qwen2":
        wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def build_model(arch: str, tokenizer: PreTrainedTokenizerFast) -> torch.nn.Module:
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    torch.manual_seed(0)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
            pad_token_id=tokenizer.pad_token_id,
        ))  # fmt: skip
    if arch == "gpt2":
        return GPT2LMHeadModel(GPT2Config(
            vocab_size=vocab, n_positions=256, n_embd=32, n_layer=2, n_head=2,
            bos_token_id=eos, eos_token_id=eos,
        ))  # fmt: skip
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
        eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True,
    ))  # fmt: skip


def teach_to_stop(model, tokenizer, *, steps: int = 40) -> None:
    """A few SFT steps on `question -> #### answer<EOS>`, so that sampled responses end within a
    few tokens about half of the time: rewards then differ within groups (a random model never
    stops, every response gets the same truncation penalty, and TB has nothing to learn)."""
    prompts, answers = task_texts(64)
    prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
    response_ids = [
        tokenizer(a, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        for a in answers
    ]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    pad = tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id
    for step in range(steps):
        rows = [(step * 16 + i) % len(prompts) for i in range(16)]
        loss = sft_loss(model, [prompt_ids[i] for i in rows], [response_ids[i] for i in rows], pad)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
