"""Environment pools on real Ray actors: order-preserving split across workers, failures scored 0."""

from posttrain.environments.pool import EnvironmentPool
from posttrain.environments.registry import EnvironmentConfig


def conversation(response: str) -> list[dict]:
    return [{"role": "user", "content": "q"}, {"role": "assistant", "content": response}]


def test_pool_splits_samples_across_actors_and_keeps_order(ray_session):
    pool = EnvironmentPool("arithmetic", EnvironmentConfig(cls="exact_match", num_workers=2, num_cpus=0.1))
    responses = ["1", "2", "3", "x", "5"]
    result = pool.step([conversation(r) for r in responses], [{"ground_truth": str(i + 1)} for i in range(5)])
    assert result.rewards.tolist() == [1.0, 1.0, 1.0, 0.0, 1.0]
    assert result.answers == responses
    pool.shutdown()


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
