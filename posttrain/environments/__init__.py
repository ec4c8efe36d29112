"""Environments score rollouts: math, exact match, sliding puzzle, code, reward model, judge, tool calls."""

from posttrain.environments.interface import EnvironmentInterface, EnvironmentReturn
from posttrain.environments.pool import EnvironmentPool, create_environments
from posttrain.environments.registry import (
    EnvironmentConfig,
    register_environment,
    resolve_environment_class,
    tool_prompts,
)

__all__ = [
    "EnvironmentConfig",
    "EnvironmentInterface",
    "EnvironmentPool",
    "EnvironmentReturn",
    "create_environments",
    "register_environment",
    "resolve_environment_class",
    "tool_prompts",
]
