"""The project's tokenizers (character and byte-level BPE): round trips, special tokens and the chat
template."""

import pytest

from posttrain.models.tokenizer import build_byte_tokenizer, build_char_tokenizer, tokenizer_mismatch


def test_text_round_trips_character_by_character():
    tokenizer = build_char_tokenizer()
    text = "Q: 07+85=?\nA: 092"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text


def test_chat_template_renders_roles_and_ends_assistant_turn_with_eos():
    tokenizer = build_char_tokenizer()
    messages = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert tokenizer.decode(ids) == "<|user|>1+2=<|assistant|>3<eos>"
    assert ids[-1] == tokenizer.eos_token_id == 2
    assert tokenizer.pad_token_id == 0


def test_chat_template_generation_prompt_and_unknown_role():
    tokenizer = build_char_tokenizer()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "5"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|user|>5<|assistant|>"
    with pytest.raises(Exception, match="unsupported role: narrator"):
        tokenizer.apply_chat_template([{"role": "narrator", "content": "x"}], tokenize=False)


def test_tokenizer_saves_and_reloads(tmp_path):
    from transformers import AutoTokenizer

    build_char_tokenizer().save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded.decode(reloaded("x y=1")["input_ids"]) == "x y=1"
    assert reloaded.eos_token == "<eos>" and reloaded.pad_token == "<pad>"


# ------------------------------------------------------------------------------------- byte-level BPE
def test_byte_tokenizer_has_300_tokens_and_the_char_tokenizers_special_ids():
    byte, char = build_byte_tokenizer(), build_char_tokenizer()
    assert len(byte) == 300
    for name in ("pad", "bos", "eos", "unk"):
        assert getattr(byte, f"{name}_token") == getattr(char, f"{name}_token")
        assert getattr(byte, f"{name}_token_id") == getattr(char, f"{name}_token_id")
    assert byte.convert_tokens_to_ids(["<|user|>", "<|assistant|>"]) == [5, 6]


@pytest.mark.parametrize("text", ["07+85=092", "Hello, wörld ✓\n\tdef f(x):  return x", ""])
def test_byte_tokenizer_round_trips_any_text(text):
    tokenizer = build_byte_tokenizer()
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert len(ids) <= len(text.encode())  # merges only ever shorten the byte sequence


def test_byte_tokenizer_merges_frequent_pairs_of_its_corpus():
    tokenizer = build_byte_tokenizer()
    assert len(tokenizer("07+85=092")["input_ids"]) < len("07+85=092")


def test_byte_tokenizer_training_is_deterministic():
    assert (
        build_byte_tokenizer().backend_tokenizer.to_str() == build_byte_tokenizer().backend_tokenizer.to_str()
    )


def test_byte_tokenizer_chat_template_matches_the_char_tokenizer():
    tokenizer = build_byte_tokenizer()
    messages = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert tokenizer.decode(ids) == "<|user|>1+2=<|assistant|>3<eos>"
    assert ids[0] == 5 and ids[-1] == tokenizer.eos_token_id == 2
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == build_char_tokenizer().apply_chat_template(
        messages[:1], tokenize=False, add_generation_prompt=True
    )


def test_byte_tokenizer_saves_and_reloads(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = build_byte_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "<|user|>héllo 12+3=<|assistant|>015<eos>"
    assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert reloaded.decode(reloaded(text)["input_ids"]) == text
    assert len(reloaded) == 300 and reloaded.chat_template == tokenizer.chat_template


def test_tokenizer_mismatch_accepts_the_same_vocabulary_and_names_the_first_difference():
    """Two builds of the character tokenizer give the same ids; the byte-level BPE has 300 tokens, the
    character one fewer; a character tokenizer whose eos is another token differs only there."""
    char = build_char_tokenizer()
    assert tokenizer_mismatch(char, build_char_tokenizer()) is None
    message = tokenizer_mismatch(char, build_byte_tokenizer())
    assert message is not None and "300" in message and str(len(char.get_vocab())) in message
    other_eos = build_char_tokenizer()
    other_eos.eos_token = "<pad>"
    expected = "eos_token is '<eos>' for the student, '<pad>' for the teacher"
    assert tokenizer_mismatch(char, other_eos) == expected
