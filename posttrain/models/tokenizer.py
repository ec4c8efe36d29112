"""The project's own character-level tokenizer: offline, tiny, with special tokens and a chat template."""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
ROLE_TOKENS = {
    "system": "<|system|>",
    "user": "<|user|>",
    "assistant": "<|assistant|>",
    "tool": "<|tool|>",
    "environment": "<|env|>",
}
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK, *ROLE_TOKENS.values()]
CHARACTERS = list(string.printable[:95]) + ["\n"]  # digits, letters, punctuation, space, newline

# Each message renders as <|role|> content, and an assistant turn ends with <eos>. Roles outside
# ROLE_TOKENS fail loudly at render time (see data/), instead of being silently dropped.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<|system|>' + message['content'] }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>' + message['content'] + '<eos>' }}"
    "{% elif message['role'] == 'tool' %}{{ '<|tool|>' + message['content'] }}"
    "{% elif message['role'] == 'environment' %}{{ '<|env|>' + message['content'] }}"
    "{% else %}{{ raise_exception('unsupported role: ' + message['role']) }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer (~105 tokens) with pad/bos/eos/unk, role tokens and a chat template."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character is its own pre-token; special tokens are matched before pre-tokenization.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="right",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
