"""The project's character tokenizer: round trips, special tokens and its chat template."""

import pytest

from posttrain.models.tokenizer import build_char_tokenizer


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
