"""Environments score rollouts: math (final answer), exact match, sliding puzzle, code tool, reward model."""

from posttrain.environments.interface import EnvironmentInterface, EnvironmentReturn
from posttrain.environments.pool import EnvironmentPool, create_environments
from posttrain.environments.registry import EnvironmentConfig, register_environment, resolve_environment_class

__all__ = [
    "EnvironmentConfig",
    "EnvironmentInterface",
    "EnvironmentPool",
    "EnvironmentReturn",
    "create_environments",
    "register_environment",
    "resolve_environment_class",
]
