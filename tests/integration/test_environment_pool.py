"""Environment pools on real Ray actors: order-preserving split across workers, failures scored 0,
dead actors restarted, their samples scored again."""

import pytest

from posttrain.config import ConfigError, validate_config
from posttrain.environments.pool import EnvironmentPool
from posttrain.environments.registry import EnvironmentConfig
from posttrain.environments.sandbox import SandboxUnavailableError, sandbox_mode


def conversation(response: str) -> list[dict]:
    return [{"role": "user", "content": "q"}, {"role": "assistant", "content": response}]


@pytest.mark.parametrize("num_workers", [2, 0])
def test_pool_splits_samples_across_actors_and_keeps_order(ray_session, num_workers):
    """Two actors, or none (`num_workers: 0`: the environment runs in the driver), score alike."""
    pool = EnvironmentPool("arithmetic", EnvironmentConfig(cls="exact_match", num_workers=num_workers))
    assert len(pool.actors) == num_workers and (pool.local is None) == (num_workers > 0)
    responses = ["1", "2", "3", "x", "5"]
    result = pool.step([conversation(r) for r in responses], [{"ground_truth": str(i + 1)} for i in range(5)])
    assert result.rewards.tolist() == [1.0, 1.0, 1.0, 0.0, 1.0]
    assert result.answers == responses
    pool.shutdown()
    with pytest.raises(ConfigError, match=r"num_workers: must be >= 0 \(0: in the driver\), got -1"):
        validate_config(EnvironmentConfig, {"num_workers": -1})


def test_environment_that_raises_is_scored_zero_and_counted(ray_session, tmp_path):
    path = tmp_path / "broken_env.py"
    path.write_text(
        "from posttrain.environments.interface import EnvironmentInterface\n"
        "class BrokenEnv(EnvironmentInterface):\n"
        "    def step(self, message_logs, metadata):\n"
        "        raise RuntimeError('reward function exploded')\n"
    )
    pool = EnvironmentPool("broken", EnvironmentConfig(cls=f"{path}:BrokenEnv", num_workers=1, num_cpus=0.1))
    result = pool.step([conversation("a"), conversation("b")], [{}, {}])
    assert result.rewards.tolist() == [0.0, 0.0]
    assert result.terminateds.tolist() == [True, True]
    assert result.num_errors == 2
    pool.shutdown()


def test_samples_that_kill_their_actor_twice_score_zero_and_are_counted(ray_session, tmp_path):
    """The actor's process is killed mid-step by a sample (as model code that reached its parent would):
    its samples are scored again on a fresh actor, which dies too; they score 0 and count as errors, the
    run goes on (two replacements), and the next step runs on a fresh actor."""
    path = tmp_path / "fragile_env.py"
    path.write_text(
        "import os, signal, torch\n"
        "from posttrain.environments.interface import EnvironmentInterface, EnvironmentReturn\n"
        "class FragileEnv(EnvironmentInterface):\n"
        "    def step(self, message_logs, metadata):\n"
        "        if any(log[-1]['content'] == 'die' for log in message_logs):\n"
        "            os.kill(os.getpid(), signal.SIGKILL)\n"
        "        n = len(message_logs)\n"
        "        return EnvironmentReturn([{'role': 'environment', 'content': ''}] * n, metadata, [None] * "
        "n,\n"
        "                                 torch.ones(n), torch.ones(n, dtype=torch.bool), ['ok'] * n)\n"
    )
    pool = EnvironmentPool(
        "fragile", EnvironmentConfig(cls=f"{path}:FragileEnv", num_workers=2, num_cpus=0.1)
    )
    try:
        died = pool.step([conversation(r) for r in ["a", "b", "die", "c"]], [{}] * 4)
        assert died.rewards.tolist() == [1.0, 1.0, 0.0, 0.0]
        assert died.num_errors == 2 and pool.num_restarts == 2
        after = pool.step([conversation(r) for r in ["d", "e", "f", "g"]], [{}] * 4)
        assert after.rewards.tolist() == [1.0, 1.0, 1.0, 1.0] and after.num_errors == 0
    finally:
        pool.shutdown()


def test_an_actor_lost_once_costs_no_rewards(ray_session, tmp_path):
    """The actor dies the first time it scores (as when its node is lost; a marker file makes it happen
    once): a new actor scores the same samples, every reward stands and no error is counted."""
    marker = tmp_path / "died_once"
    path = tmp_path / "lost_once_env.py"
    path.write_text(
        "import os, pathlib, signal, torch\n"
        "from posttrain.environments.interface import EnvironmentInterface, EnvironmentReturn\n"
        "class LostOnceEnv(EnvironmentInterface):\n"
        "    def step(self, message_logs, metadata):\n"
        f"        marker = pathlib.Path({str(marker)!r})\n"
        "        if not marker.exists():\n"
        "            marker.touch()\n"
        "            os.kill(os.getpid(), signal.SIGKILL)\n"
        "        n = len(message_logs)\n"
        "        rewards = torch.tensor([float(log[-1]['content'] == 'right') for log in message_logs])\n"
        "        observations = [{'role': 'environment', 'content': ''}] * n\n"
        "        return EnvironmentReturn(observations, metadata, [None] * n,\n"
        "                                 rewards, torch.ones(n, dtype=torch.bool), ['ok'] * n)\n"
    )
    pool = EnvironmentPool("lost", EnvironmentConfig(cls=f"{path}:LostOnceEnv", num_workers=1, num_cpus=0.1))
    try:
        result = pool.step([conversation(r) for r in ["right", "wrong", "right"]], [{}] * 3)
        assert result.rewards.tolist() == [1.0, 0.0, 1.0]
        assert result.num_errors == 0 and pool.num_restarts == 1 and marker.exists()
    finally:
        pool.shutdown()


def test_environment_that_cannot_start_stops_the_run_naming_the_task(ray_session, tmp_path):
    path = tmp_path / "unstartable_env.py"
    path.write_text(
        "from posttrain.environments.interface import EnvironmentInterface\n"
        "class UnstartableEnv(EnvironmentInterface):\n"
        "    def __init__(self):\n"
        "        raise RuntimeError('no sandbox here')\n"
        "    def step(self, message_logs, metadata):\n"
        "        pass\n"
    )
    with pytest.raises(RuntimeError, match=r"(?s)env\.unstartable: .*failed to start.*no sandbox here"):
        EnvironmentPool("unstartable", EnvironmentConfig(cls=f"{path}:UnstartableEnv", num_cpus=0.1))


def test_model_code_that_kills_its_parent_leaves_the_code_actor_running(ray_session):
    pytest.importorskip("math_verify")
    try:
        sandbox_mode()
    except SandboxUnavailableError as error:
        pytest.skip(str(error))
    pool = EnvironmentPool("code", EnvironmentConfig(cls="code", num_cpus=0.1))
    try:
        attack = "<code>import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint(6 * 7)</code>"
        first = pool.step([conversation(attack)], [{"ground_truth": "42"}])
        assert first.num_errors == 0 and pool.num_restarts == 0
        assert "PermissionError" in first.observations[0]["content"]
        final = pool.step([conversation("The answer is 42")], first.metadata)
        assert final.rewards.tolist() == [1.0] and pool.num_restarts == 0
    finally:
        pool.shutdown()
