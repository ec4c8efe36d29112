"""Environments score rollouts: math, exact match, sliding puzzle, code, reward model, judge, tool calls,
or a user's plain reward function."""

from posttrain.environments.interface import EnvironmentInterface, EnvironmentReturn
from posttrain.environments.pool import EnvironmentPool, create_environments
from posttrain.environments.registry import (
    EnvironmentConfig,
    register_environment,
    resolve_environment,
    resolve_environment_class,
    tool_prompts,
)
from posttrain.environments.reward_function import RewardFunctionEnvironment, register_reward

__all__ = [
    "EnvironmentConfig",
    "EnvironmentInterface",
    "EnvironmentPool",
    "EnvironmentReturn",
    "RewardFunctionEnvironment",
    "create_environments",
    "register_environment",
    "register_reward",
    "resolve_environment",
    "resolve_environment_class",
    "tool_prompts",
]
