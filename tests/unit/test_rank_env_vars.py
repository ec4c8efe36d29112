"""rank_env_vars: the environment each rank of a worker group starts with."""

from posttrain.distributed.worker_group import rank_env_vars


def test_rank_env_vars_place_each_worker_in_the_group():
    """Rank 5 of 8 with 4 workers per node is local rank 1 on node 1."""
    env = rank_env_vars(5, 8, 4, "10.0.0.1", 29500, 2)
    assert env == {
        "OMP_NUM_THREADS": "2",
        "MKL_NUM_THREADS": "2",
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "NODE_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
    }


def test_extra_env_vars_are_added_to_each_rank():
    """The group's extra variables (a rendezvous file, the node's address) join the rank's own."""
    env = rank_env_vars(0, 1, 1, "127.0.0.1", 1234, 4, {"POSTTRAIN_NODE_IP": "10.0.0.2"})
    assert env["POSTTRAIN_NODE_IP"] == "10.0.0.2" and env["RANK"] == "0" and env["MKL_NUM_THREADS"] == "4"
