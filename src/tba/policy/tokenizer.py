"""A character-level tokenizer for the built-in policy, made with the `tokenizers` library.

Wrapping it in `PreTrainedTokenizerFast` means the rest of the code treats it exactly like the
tokenizer of any Hugging Face model (`save_pretrained`, `AutoTokenizer.from_pretrained`, padding).
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
CHARSET = string.ascii_letters + string.digits + " \n.,?!:;'$%#+-*/=()<>"


def build_char_tokenizer(charset: str = CHARSET) -> PreTrainedTokenizerFast:
    """One token per character; BOS is prepended to every encoded text, EOS ends responses."""
    specials = [PAD, BOS, EOS, UNK]
    vocab = {token: i for i, token in enumerate(specials + sorted(set(charset)))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    # `[\s\S]` rather than `.` so that newlines are characters too.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
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
