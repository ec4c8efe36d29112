"""The project's own offline tokenizers, with special tokens and a chat template: character-level (~105
tokens) and byte-level BPE (300 tokens, trained here on a small built-in corpus); and the check that two
tokenizers give the same ids (a distillation teacher scores the student's token ids); `load_tokenizer`
for any model directory or hub name."""

from __future__ import annotations

import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

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
    return wrap_tokenizer(backend)


def wrap_tokenizer(backend: Tokenizer, **kwargs: object) -> PreTrainedTokenizerFast:
    """A `tokenizers` backend as a Hugging Face tokenizer with the special tokens and chat template."""
    special = {"pad_token": PAD, "bos_token": BOS, "eos_token": EOS, "unk_token": UNK}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, padding_side="right", **special, **kwargs)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


BYTE_VOCAB_SIZE = 300  # 9 special tokens + 256 bytes + 35 merges


def byte_tokenizer_corpus() -> list[str]:
    """The fixed text the byte-level BPE is trained on: sums like the built-in tasks, prose, and code."""
    sums = [f"{a:02d}+{b:02d}={a + b:03d}" for a in range(0, 100, 7) for b in range(0, 100, 11)]
    prose = [
        "The answer is the sum of the two numbers.",
        "Think step by step, then give the answer on the last line.",
        "Move the tile left, right, up or down until the board is solved.",
        "def add(a, b):\n    return a + b\n",
        "print(add(2, 3))  # prints 5\n",
    ]
    return sums + prose * 4


def build_byte_tokenizer(vocab_size: int = BYTE_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (`vocab_size` tokens: special tokens, the 256 bytes, merges learnt from
    `byte_tokenizer_corpus`), with the special tokens and chat template of the character tokenizer.

    Any text round-trips (every byte has a token). Training is deterministic: the same call gives the
    same vocabulary and merges."""
    backend = Tokenizer(models.BPE(unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,  # ids 0..8, in the order of the character tokenizer
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(byte_tokenizer_corpus(), trainer=trainer)
    return wrap_tokenizer(backend, clean_up_tokenization_spaces=False)


TOKENIZERS = {"char": build_char_tokenizer, "byte": build_byte_tokenizer}


def tokenizer_mismatch(student: PreTrainedTokenizerBase, teacher: PreTrainedTokenizerBase) -> str | None:
    """None when both tokenizers map every token to the same id and agree on the eos and pad tokens, so
    that a teacher can score the student's token ids as they are; else the first difference, in words."""
    student_vocab, teacher_vocab = student.get_vocab(), teacher.get_vocab()
    if len(student_vocab) != len(teacher_vocab):
        return f"the student's vocabulary has {len(student_vocab)} tokens, the teacher's {len(teacher_vocab)}"
    for token, index in sorted(student_vocab.items(), key=lambda item: item[1]):
        if teacher_vocab.get(token) != index:
            teacher_index = teacher_vocab.get(token)
            return f"token {token!r} is id {index} for the student and {teacher_index} for the teacher"
    for name in ("eos_token", "pad_token"):
        ours, theirs = getattr(student, name), getattr(teacher, name)
        if ours != theirs:
            return f"{name} is {ours!r} for the student, {theirs!r} for the teacher"
    return None


def load_tokenizer(path_or_name: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a local directory or hub name; a missing pad token falls back to the eos token."""
    tokenizer = AutoTokenizer.from_pretrained(str(path_or_name))
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer of {path_or_name} has neither a pad token nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
