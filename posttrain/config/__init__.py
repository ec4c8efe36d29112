"""Configuration: YAML files with `defaults:` inheritance, Hydra-style command-line overrides,
`${...}` interpolation (resolved after all merging) and validation into typed `@dataclass` schemas.
Every error is a `ConfigError` naming the dotted key and the file (or "command line") that set it.

`load` reads and merges files, `overrides` parses and applies command-line overrides, `schema` checks a
config against its typed schema; `errors` and `tree` are what they share."""

from posttrain.config.errors import COMMAND_LINE, MISSING_MARK, ConfigError, closest, join_key, source_of
from posttrain.config.load import (
    LoadedConfig,
    load_config,
    load_run_config,
    load_typed_config,
    resolve_config,
)
from posttrain.config.overrides import Override, apply_overrides, parse_override, parse_overrides
from posttrain.config.schema import (
    config_to_dict,
    describe_config,
    format_config_help,
    save_config,
    schema_defaults,
    validate_config,
)
from posttrain.config.tree import iter_keys, iter_leaves

__all__ = [
    "COMMAND_LINE",
    "MISSING_MARK",
    "ConfigError",
    "LoadedConfig",
    "Override",
    "apply_overrides",
    "closest",
    "config_to_dict",
    "describe_config",
    "format_config_help",
    "iter_keys",
    "iter_leaves",
    "join_key",
    "load_config",
    "load_run_config",
    "load_typed_config",
    "parse_override",
    "parse_overrides",
    "resolve_config",
    "save_config",
    "schema_defaults",
    "source_of",
    "validate_config",
]
