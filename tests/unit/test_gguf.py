"""GGUF model names: which names are GGUF files, where their plain directory goes, and the errors."""

import pytest

from posttrain.config import ConfigError
from posttrain.models.gguf import default_cache_dir, gguf_model_dir, is_gguf


def test_only_gguf_names_are_converted_and_others_pass_through():
    assert is_gguf("models/SmolLM2.Q4_1.GGUF") and not is_gguf("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert not is_gguf(None)
    assert gguf_model_dir("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_a_file_in_a_writable_folder_is_converted_beside_it(tmp_path):
    model = tmp_path / "m.Q4_1.gguf"
    model.write_bytes(b"x")
    assert default_cache_dir(model) == tmp_path / "m.Q4_1.gguf.hf"


def test_a_missing_file_names_the_config_key_and_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.model_name: GGUF file .*nothing\.gguf does not exist"):
        gguf_model_dir(str(tmp_path / "nothing.gguf"), key="model.model_name")


def test_a_file_that_is_not_gguf_is_an_error_naming_it(tmp_path):
    bogus = tmp_path / "broken.gguf"
    bogus.write_bytes(b"not a gguf file at all")
    with pytest.raises(
        ConfigError, match=r"policy\.model_name: transformers cannot dequantize .*broken\.gguf"
    ):
        gguf_model_dir(str(bogus), key="policy.model_name", cache_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()
