"""Tokenizers: the character-level one of the built-in policy, and loading any model's.

The built-in tokenizer is made with the `tokenizers` library; wrapping it in
`PreTrainedTokenizerFast` means the rest of the code treats it exactly like the tokenizer of any
Hugging Face model (`save_pretrained`, `AutoTokenizer.from_pretrained`, padding). Every tokenizer
is loaded by `load_tokenizer` and every prompt encoded by `encode_prompts`, in the trainer's
process and the searchers' alike.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from tba.core import Prompt
from tba.errors import ConfigError, first_line
from tba.policy.gguf import gguf_file, load_gguf_tokenizer

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
# What `save_pretrained` writes for a tokenizer of any kind (fast, sentencepiece, BPE, WordPiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "vocab.txt")  # fmt: skip
CHARSET = string.ascii_letters + string.digits + " \n.,?!:;'$%#+-*/=()<>"


def build_char_tokenizer(charset: str = CHARSET) -> PreTrainedTokenizerFast:
    """One token per character; BOS is prepended to every encoded text, EOS ends responses."""
    # `[\s\S]` rather than `.` so that newlines are characters too.
    split = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    return _closed_vocabulary(set(charset), split, decoders.Fuse())


def build_word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """One token per whitespace-separated word of a closed vocabulary (the embedded red-teaming
    world's); decoding joins words with spaces. BOS is prepended to every encoded text."""
    joins_with_spaces = decoders.WordPiece(prefix="##", cleanup=False)
    return _closed_vocabulary(set(words), pre_tokenizers.WhitespaceSplit(), joins_with_spaces)


def _closed_vocabulary(symbols: set[str], pre_tokenizer, decoder) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over `symbols` (sorted, after the special tokens), left-padded,
    prepending BOS to every encoded text."""
    specials = [PAD, BOS, EOS, UNK]
    vocab = {token: i for i, token in enumerate(specials + sorted(symbols))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoder
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
    )


def load_tokenizer(path: str, *, chat_template: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer saved with a policy, ready for batched sampling; `chat_template`: it must
    have one.

    A response ends at EOS, so a tokenizer without one is refused. One without a pad token (GPT-2,
    Llama) pads with EOS: every mask is built from sequence lengths, never from `ids != pad`, so a
    pad id equal to EOS is harmless. Padding goes on the left, where generation needs it. A GGUF
    file (or a directory holding one and no config.json) gives the tokenizer it stores.
    """
    local = Path(path).expanduser()
    gguf = gguf_file(local)
    if gguf is not None:
        tokenizer = load_gguf_tokenizer(gguf)
    elif local.is_dir() and not any((local / name).exists() for name in TOKENIZER_FILES):
        raise ConfigError(f"no tokenizer in {path} (none of {', '.join(TOKENIZER_FILES)}): "
                          "save the model's tokenizer beside it (tokenizer.save_pretrained)")
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except Exception as error:  # incomplete, damaged, unknown: all one line to a user
            raise ConfigError(f"cannot load a tokenizer from {path}: {first_line(error)}") from None
    if tokenizer.eos_token_id is None:
        raise ConfigError(
            f"policy.model: the tokenizer in {path} has no EOS token, so responses could not end"
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    if chat_template and not tokenizer.chat_template:
        raise ConfigError(
            f"the tokenizer in {path} has no chat template, which policy.chat_template=true and "
            "conversational prompts need"
        )
    return tokenizer


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    *,
    chat_template: bool = False,
    max_length: int | None = None,
) -> list[list[int]]:
    """Token ids of each prompt. A conversation (a list of `{"role", "content"}` messages) is
    rendered by the tokenizer's chat template, followed by the opening of the assistant's turn,
    which the response continues, or, when the last message is the assistant's, by nothing: the
    response continues that message (a prefilled answer). A text prompt is encoded as it is
    (with the tokenizer's special tokens, e.g. BOS), or with `chat_template` as one user turn,
    for instruct models. With `max_length`, a longer prompt keeps its last `max_length` tokens
    (the end, which the response continues)."""
    ids = []
    for prompt in prompts:
        if isinstance(prompt, str) and not chat_template:
            ids.append(tokenizer(prompt)["input_ids"])
            continue
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        prefilled = messages[-1]["role"] == "assistant"
        chat = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=not prefilled,
            continue_final_message=prefilled,
        )  # fmt: skip
        # The template writes its own special tokens (BOS included); adding them again would
        # double them.
        ids.append(tokenizer(chat, add_special_tokens=False)["input_ids"])
    if max_length is not None:
        ids = [prompt[-max_length:] for prompt in ids]
    return ids
