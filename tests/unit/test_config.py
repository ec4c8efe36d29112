"""Tests of posttrain.config: inheritance, `_override_`, interpolation, resolvers, overrides, validation."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import pytest
import yaml
from omegaconf import OmegaConf

from posttrain.config import (
    ConfigError,
    Override,
    config_to_dict,
    describe_config,
    format_config_help,
    load_config,
    load_typed_config,
    parse_overrides,
    save_config,
    validate_config,
)

DATA = Path(__file__).parent / "data" / "config"
BASE = str(DATA / "base.yaml")
PARENT_A = str(DATA / "parent_a.yaml")
PARENT_B = str(DATA / "sub" / "parent_b.yaml")
CHILD = str(DATA / "child.yaml")
TYPED = str(DATA / "typed.yaml")


# ------------------------------------------------------------------------------------- test schemas


@dataclass
class OptimizerSection:
    name: str = field(default="adam", metadata={"help": "Optimizer name."})
    kwargs: dict[str, float] = field(default_factory=dict, metadata={"help": "Optimizer keyword arguments."})


@dataclass
class PolicySection:
    lr: float = field(default=1e-3, metadata={"help": "Learning rate."})
    mode: Literal["fast", "slow"] = field(default="slow", metadata={"help": "Speed mode."})
    layers: list[int] = field(default_factory=lambda: [4], metadata={"help": "Layer widths."})
    dropout: Optional[float] = field(default=None, metadata={"help": "Dropout probability, off if null."})
    optimizer: OptimizerSection = field(default_factory=OptimizerSection, metadata={"help": "Optimizer."})


@dataclass
class RunSection:
    name: str = field(metadata={"help": "Run name (mandatory)."})
    steps: int = field(default=1, metadata={"help": "Training steps."})
    tag: str | None = field(default=None, metadata={"help": "Free tag."})
    extra: Any = field(default=None, metadata={"help": "Anything."})


@dataclass
class DataSection:
    batch_size: int = field(default=4, metadata={"help": "Global batch size."})
    micro_batch_size: int = field(default=4, metadata={"help": "Micro-batch size."})

    def validate(self) -> None:
        if self.batch_size % self.micro_batch_size != 0:
            raise ConfigError("micro_batch_size", f"must divide batch_size={self.batch_size}")


@dataclass
class TrainConfig:
    run: RunSection = field(default_factory=lambda: RunSection(name="default"), metadata={"help": "Run."})
    policy: PolicySection = field(default_factory=PolicySection, metadata={"help": "Policy."})
    data: DataSection = field(default_factory=DataSection, metadata={"help": "Data."})

    def validate(self) -> None:
        if self.policy.mode == "fast" and self.run.steps > 100:
            raise ValueError("policy.mode=fast allows at most 100 run.steps")


def typed_tree() -> dict[str, Any]:
    return OmegaConf.to_container(load_config(TYPED).cfg)  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------- inheritance


def test_two_level_inheritance_merges_parents_left_to_right_and_child_wins():
    loaded = load_config(CHILD)
    cfg = loaded.cfg
    assert cfg.run.name == "b"  # parent_a says a, sub/parent_b (later in the list) says b
    assert cfg.policy.lr == 0.01  # parent_a over base; the shared base does not undo it via parent_b
    assert cfg.policy.hidden == 32  # child over parent_b's 128 and base's 64
    assert cfg.run.seed == 1 and cfg.run.steps == 10  # base; child fills the mandatory ???
    assert cfg.data.batch_size == 64
    assert loaded.sources["run.name"] == PARENT_B
    assert loaded.sources["policy.lr"] == PARENT_A
    assert loaded.sources["policy.hidden"] == CHILD
    assert loaded.sources["run.seed"] == BASE
    assert loaded.sources["policy.optimizer.betas"] == BASE
    assert "defaults" not in cfg


def test_override_marker_replaces_parent_section_instead_of_merging():
    loaded = load_config(DATA / "replace_section.yaml")
    optimizer = OmegaConf.to_container(loaded.cfg.policy.optimizer)
    assert optimizer == {"name": "sgd", "momentum": 0.9}  # base's betas are gone, no _override_ key left
    assert "policy.optimizer.betas" not in loaded.sources
    assert loaded.sources["policy.optimizer.momentum"] == str(DATA / "replace_section.yaml")
    assert loaded.cfg.policy.hidden == 32  # sections without the marker still merge


def test_inheritance_cycle_is_an_error_naming_the_chain():
    with pytest.raises(
        ConfigError, match=r"inheritance cycle: .*cycle_a.yaml -> .*cycle_b.yaml -> .*cycle_a"
    ):
        load_config(DATA / "cycle_a.yaml")


def test_missing_parent_file_names_the_file_that_asks_for_it():
    with pytest.raises(ConfigError) as caught:
        load_config(DATA / "missing_parent.yaml")
    assert "parent config not found" in str(caught.value) and "no_such_file.yaml" in str(caught.value)
    assert caught.value.source == str(DATA / "missing_parent.yaml")


def test_mandatory_value_left_missing_names_key_and_file():
    with pytest.raises(ConfigError) as caught:
        load_config(BASE)
    assert str(caught.value) == f"run.steps: missing mandatory value (???) (from {BASE})"


def test_invalid_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("a: 1\nb: [1, 2\n")
    with pytest.raises(ConfigError, match=rf"{path}:\d+: invalid YAML"):
        load_config(path)


# -------------------------------------------------------------------------------------- interpolation


def test_interpolation_follows_value_changed_by_child():
    cfg = load_config(CHILD).cfg
    assert cfg.policy.ffn == 128  # ${mul:${policy.hidden},4} with the child's hidden=32, not base's 64
    assert cfg.data.micro_batch_size == 16  # ${div:${data.batch_size},4} with parent_b's 64


def test_interpolation_follows_value_changed_on_command_line():
    loaded = load_config(CHILD, ["policy.hidden=10", "data.batch_size=8"])
    assert loaded.cfg.policy.ffn == 40
    assert loaded.cfg.data.micro_batch_size == 2
    assert loaded.sources["policy.hidden"] == "command line"


def test_resolvers_add_mul_div_max():
    cfg = load_config(DATA / "resolvers.yaml").cfg  # a=6, b=4
    assert cfg.sum == 11  # 6 + 4 + 1
    assert cfg.product == 48  # 6 * 4 * 2
    assert cfg.exact_ratio == 3 and isinstance(cfg.exact_ratio, int)  # 6 / 2 divides exactly
    assert cfg.ratio == 1.5  # 6 / 4
    assert cfg.largest == 6  # max(6, 4, 5)


def test_interpolation_to_unknown_key_names_the_key_using_it(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("a: ${nope.b}\n")
    with pytest.raises(ConfigError, match=rf"^a: cannot resolve interpolation: .*nope.*\(from {path}\)$"):
        load_config(path)


# ------------------------------------------------------------------------------------------ overrides


def test_parse_overrides_every_form_with_yaml_values():
    parsed = parse_overrides(["a.b=1", "+a.c=[1, 2]", "++a.d=null", "~a.e", "a.f=1e-4", "a.g=", "a.h=x=y"])
    assert parsed == [
        Override("set", "a.b", 1, "a.b=1"),
        Override("add", "a.c", [1, 2], "+a.c=[1, 2]"),
        Override("force", "a.d", None, "++a.d=null"),
        Override("delete", "a.e", None, "~a.e"),
        Override("set", "a.f", 1e-4, "a.f=1e-4"),
        Override("set", "a.g", "", "a.g="),
        Override("set", "a.h", "x=y", "a.h=x=y"),
    ]


@pytest.mark.parametrize(
    "text, message",
    [
        ("a.b", "has no value: write 'a.b=VALUE'"),
        ("~a.b=1", "a delete takes no value"),
        ("=1", "invalid override '=1'"),
        ("a..b=1", "invalid override 'a..b=1'"),
        ("a=[1,", "cannot parse value '[1,' as YAML"),
    ],
)
def test_parse_overrides_rejects_malformed_text(text, message):
    with pytest.raises(ConfigError, match="command line") as caught:
        parse_overrides([text])
    assert message in str(caught.value)


@pytest.mark.parametrize(
    "text, value",
    [
        ("010", "010"),  # YAML 1.1: 8 (octal)
        ("1:30", "1:30"),  # YAML 1.1: 90 (sexagesimal)
        ("yes", "yes"),  # YAML 1.1: True
        ("on", "on"),
        ("0x10", "0x10"),  # YAML 1.1: 16
        ("True", True),
        ("null", None),
        ("-3", -3),
        ("1_000", 1000),
        ("2.0e-5", 2.0e-5),
        ("[1, 010]", [1, "010"]),
    ],
)
def test_override_values_follow_hydras_grammar_not_yaml_1_1(text, value):
    assert parse_overrides([f"a={text}"])[0].value == value


def test_inf_and_nan_overrides_are_floats():
    values = [override.value for override in parse_overrides(["a=inf", "a=-inf", "a=nan"])]
    assert values[:2] == [float("inf"), float("-inf")] and values[2] != values[2]


def test_a_dict_override_merges_into_the_section_and_override_mark_replaces_it():
    """base.yaml's policy.optimizer is {name: adam, betas: [0.9, 0.999]}: a dict sets name and keeps betas
    (with their source); `_override_: true` replaces the section."""
    loaded = load_config(CHILD, ["policy.optimizer={name: sgd, momentum: 0.5}"])
    optimizer = OmegaConf.to_container(loaded.cfg.policy.optimizer)
    assert optimizer == {"name": "sgd", "betas": [0.9, 0.999], "momentum": 0.5}
    assert loaded.sources["policy.optimizer.betas"] == BASE
    assert loaded.sources["policy.optimizer.name"] == "command line"
    replaced = load_config(CHILD, ["policy.optimizer={_override_: true, name: sgd}"]).cfg
    assert OmegaConf.to_container(replaced.policy.optimizer) == {"name": "sgd"}


def test_set_override_changes_existing_key():
    cfg = load_config(CHILD, ["policy.optimizer.betas=[0.5,0.6]", "run.name=c"]).cfg
    assert list(cfg.policy.optimizer.betas) == [0.5, 0.6]
    assert cfg.run.name == "c"


def test_set_override_of_unknown_key_suggests_closest():
    with pytest.raises(ConfigError) as caught:
        load_config(CHILD, ["policy.hiden=3"])
    assert str(caught.value) == (
        "policy.hiden: cannot set a key that does not exist; use '+policy.hiden=...' to add it; "
        "did you mean 'policy.hidden'? (from command line)"
    )


def test_add_override_adds_new_key_and_rejects_existing_one():
    loaded = load_config(CHILD, ["+policy.optimizer.momentum=0.9", "+extra.flag=true"])
    assert loaded.cfg.policy.optimizer.momentum == 0.9 and loaded.cfg.extra.flag is True
    assert loaded.sources["extra.flag"] == "command line"
    with pytest.raises(
        ConfigError, match=rf"^policy.lr: cannot add a key that already exists \(set in {PARENT_A}\)"
    ):
        load_config(CHILD, ["+policy.lr=1"])


def test_force_override_adds_or_sets():
    cfg = load_config(CHILD, ["++policy.lr=0.5", "++policy.new_key={x: 1}"]).cfg
    assert cfg.policy.lr == 0.5
    assert OmegaConf.to_container(cfg.policy.new_key) == {"x": 1}


def test_delete_override_removes_key_and_rejects_absent_one():
    loaded = load_config(CHILD, ["~policy.optimizer", "~run.seed"])
    assert "optimizer" not in loaded.cfg.policy and "seed" not in loaded.cfg.run
    assert not any(key.startswith("policy.optimizer") for key in loaded.sources)
    with pytest.raises(
        ConfigError, match=r"^run.sed: cannot delete a key that does not exist; did you mean 'run.seed'"
    ):
        load_config(CHILD, ["~run.sed"])


def test_override_into_list_item_marks_whole_list_as_command_line():
    loaded = load_config(TYPED, ["policy.layers.0=5", "~policy.layers.1"])
    assert list(loaded.cfg.policy.layers) == [5]
    assert loaded.sources["policy.layers"] == "command line"
    with pytest.raises(
        ConfigError, match=r"^policy.layers.2: cannot apply '\+policy.layers.2=7': list index"
    ):
        load_config(TYPED, ["+policy.layers.2=7"])


def test_add_override_under_a_scalar_is_an_error():
    with pytest.raises(ConfigError, match=r"^policy.lr.x: 'policy.lr' holds int 1, not a section"):
        load_config(TYPED, ["++policy.lr.x=1"])


def test_override_value_may_be_an_interpolation():
    cfg = load_config(CHILD, ["run.name=${policy.optimizer.name}-${run.seed}"]).cfg
    assert cfg.run.name == "adam-1"


def test_override_sets_a_mandatory_value():
    assert load_config(BASE, ["run.steps=3"]).cfg.run.steps == 3


# ----------------------------------------------------------------------------------------- validation


def test_validate_builds_nested_dataclasses_with_types_and_defaults():
    config = validate_config(TrainConfig, load_config(TYPED).cfg)
    assert config.run == RunSection(name="typed", steps=5, tag=None, extra=None)
    assert config.policy.lr == 1.0 and isinstance(config.policy.lr, float)  # an int is a valid float
    assert config.policy.mode == "fast" and config.policy.layers == [1, 2] and config.policy.dropout is None
    assert config.policy.optimizer == OptimizerSection(name="adam", kwargs={"eps": 1e-8})
    assert config.data == DataSection(batch_size=8, micro_batch_size=4)  # ${div:8,2}


def test_validate_accepts_optional_union_and_any_values():
    tree = typed_tree()
    tree["policy"]["dropout"] = 0.1
    tree["run"]["tag"] = "x"
    tree["run"]["extra"] = {"anything": [1, "two"]}
    config = validate_config(TrainConfig, tree)
    assert config.policy.dropout == 0.1 and config.run.tag == "x"
    assert config.run.extra == {"anything": [1, "two"]}


def test_load_typed_config_loads_overrides_and_validates():
    config = load_typed_config(TrainConfig, TYPED, ["policy.mode=slow", "++run.tag=t"])
    assert config.policy.mode == "slow" and config.run.tag == "t" and config.data.micro_batch_size == 4


def test_unknown_key_names_file_and_closest_valid_key():
    loaded = load_config(TYPED, ["+policy.optimiser.name=sgd"])
    with pytest.raises(ConfigError) as caught:
        validate_config(TrainConfig, loaded.cfg, loaded.sources)
    assert str(caught.value) == (
        "policy.optimiser: unknown key in PolicySection; did you mean 'policy.optimizer'? (from command line)"
    )


def test_unknown_key_from_file_names_that_file():
    loaded = load_config(CHILD)  # has run.seed and policy.hidden, which TrainConfig does not know
    with pytest.raises(ConfigError) as caught:
        validate_config(TrainConfig, loaded.cfg, loaded.sources)
    assert caught.value.key == "run.seed"  # the first unknown key in file order
    assert caught.value.source == BASE
    assert "unknown key in RunSection" in str(caught.value)


def test_wrong_type_message_names_key_expected_type_value_and_file():
    loaded = load_config(TYPED, ["policy.lr=abc"])
    with pytest.raises(ConfigError) as caught:
        validate_config(TrainConfig, loaded.cfg, loaded.sources)
    assert str(caught.value) == "policy.lr: expected float, got str 'abc' (from command line)"


@pytest.mark.parametrize(
    "section, key, value, message",
    [
        ("run", "steps", 2.5, "run.steps: expected int, got float 2.5"),
        ("run", "steps", True, "run.steps: expected int, got bool True"),
        ("run", "tag", 3, "run.tag: expected str, got int 3"),
        ("policy", "layers", [1, "x"], "policy.layers[1]: expected int, got str 'x'"),
        ("policy", "layers", 3, "policy.layers: expected list[int], got int 3"),
        ("policy", "dropout", "high", "policy.dropout: expected float, got str 'high'"),
        (
            "policy",
            "mode",
            "fsat",
            "policy.mode: expected one of 'fast', 'slow', got str 'fsat'; did you mean 'fast'?",
        ),
        (
            "policy",
            "optimizer",
            "adam",
            "policy.optimizer: expected a mapping (OptimizerSection), got str 'adam'",
        ),
    ],
)
def test_wrong_types_are_reported_with_dotted_key(section, key, value, message):
    tree = typed_tree()
    tree[section][key] = value
    with pytest.raises(ConfigError) as caught:
        validate_config(TrainConfig, tree, {f"{section}.{key}": "x.yaml"})
    assert str(caught.value) == f"{message} (from x.yaml)"


def test_dict_value_type_is_checked_per_entry():
    tree = typed_tree()
    tree["policy"]["optimizer"]["kwargs"] = {"eps": "tiny"}
    with pytest.raises(ConfigError, match=r"^policy.optimizer.kwargs.eps: expected float, got str 'tiny'$"):
        validate_config(TrainConfig, tree)


def test_missing_mandatory_value_in_validation_names_key_and_file():
    loaded = load_config(TYPED)
    tree = OmegaConf.to_container(loaded.cfg)
    del tree["run"]["name"]  # RunSection.name has no default
    with pytest.raises(ConfigError, match=r"^run.name: missing mandatory value \(no default\)$"):
        validate_config(TrainConfig, tree)
    tree["run"]["name"] = "???"
    with pytest.raises(ConfigError, match=r"^run.name: missing mandatory value \(\?\?\?\) \(from t.yaml\)$"):
        validate_config(TrainConfig, tree, {"run.name": "t.yaml"})


def test_validate_hook_error_gets_section_prefix_and_source():
    loaded = load_config(TYPED, ["data.micro_batch_size=3"])
    with pytest.raises(ConfigError) as caught:
        validate_config(TrainConfig, loaded.cfg, loaded.sources)
    assert str(caught.value) == "data.micro_batch_size: must divide batch_size=8 (from command line)"


def test_validate_hook_plain_value_error_names_the_section():
    loaded = load_config(TYPED, ["run.steps=101"])
    with pytest.raises(ConfigError) as caught:
        validate_config(TrainConfig, loaded.cfg, loaded.sources)
    assert str(caught.value).startswith("policy.mode=fast allows at most 100 run.steps")
    assert caught.value.key == ""


# ------------------------------------------------------------------------------------- output and help


def test_save_and_reload_round_trip(tmp_path):
    config = validate_config(TrainConfig, load_config(TYPED).cfg)
    save_config(config, tmp_path / "out" / "config.yaml")
    saved = yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())
    assert saved == config_to_dict(config)
    assert saved["data"] == {"batch_size": 8, "micro_batch_size": 4}
    assert validate_config(TrainConfig, saved) == config


def test_save_dictconfig_writes_resolved_values(tmp_path):
    save_config(load_config(CHILD).cfg, tmp_path / "config.yaml")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["policy"]["ffn"] == 128 and saved["data"]["micro_batch_size"] == 16


def test_describe_config_lists_dotted_keys_defaults_and_help():
    rows = describe_config(TrainConfig)
    by_key = {key: (default, help_text) for key, default, help_text in rows}
    assert [key for key, _, _ in rows][:4] == ["run.name", "run.steps", "run.tag", "run.extra"]
    assert by_key["run.name"] == ("default", "Run name (mandatory).")  # default of the section instance
    assert by_key["policy.lr"] == ("0.001", "Learning rate.")
    assert by_key["policy.layers"] == ("[4]", "Layer widths.")
    assert by_key["policy.dropout"] == ("null", "Dropout probability, off if null.")
    assert by_key["policy.optimizer.kwargs"] == ("{}", "Optimizer keyword arguments.")
    assert describe_config(RunSection)[0] == ("name", "???", "Run name (mandatory).")


def test_format_config_help_has_one_aligned_line_per_key():
    lines = format_config_help(RunSection).splitlines()
    assert [line.split()[:2] for line in lines] == [
        ["name", "???"],
        ["steps", "1"],
        ["tag", "null"],
        ["extra", "null"],
    ]
    assert lines[1].index("1") == lines[0].index("???")  # defaults start in one column


def test_config_error_survives_pickling_with_its_fields():
    error = pickle.loads(pickle.dumps(ConfigError("a.b", "bad value", "f.yaml", "a.c")))
    assert (error.key, error.message, error.source, error.suggestion) == ("a.b", "bad value", "f.yaml", "a.c")
    assert str(error) == "a.b: bad value; did you mean 'a.c'? (from f.yaml)"


def test_mandatory_mark_in_a_file_is_not_filled_by_a_schema_default(tmp_path):
    """policy.lr has a schema default (1e-3); a file that says `???` demands it from the command line."""
    path = tmp_path / "demands_lr.yaml"
    path.write_text("run:\n  name: r\npolicy:\n  lr: ???\n")
    with pytest.raises(
        ConfigError, match=rf"^policy.lr: missing mandatory value \(\?\?\?\) \(from {path}\)$"
    ):
        load_typed_config(TrainConfig, str(path))
    assert load_typed_config(TrainConfig, str(path), ["policy.lr=0.5"]).policy.lr == 0.5


def test_a_learning_rate_set_beside_the_optimizer_points_into_its_kwargs(tmp_path):
    """`policy.lr`, on the command line or in a file, names the key that holds the learning rate."""
    from posttrain.algorithms.sft import SFTConfig

    configs = Path(__file__).resolve().parents[2] / "configs"
    with pytest.raises(ConfigError, match=r"did you mean 'policy\.optimizer\.kwargs\.lr'"):
        load_typed_config(SFTConfig, str(configs / "sft_tiny.yaml"), ["policy.lr=1e-5"])
    in_file = tmp_path / "lr.yaml"
    in_file.write_text("defaults: " + str(configs / "sft_tiny.yaml") + "\npolicy:\n  lr: 1.0e-5\n")
    with pytest.raises(ConfigError, match=r"did you mean 'policy\.optimizer\.kwargs\.lr'"):
        load_typed_config(SFTConfig, str(in_file))
