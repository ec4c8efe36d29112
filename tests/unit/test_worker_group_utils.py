"""worker_group_utils: helper functions that merge configuration options and dictionaries, used to
consolidate the settings of distributed worker groups (environment variables of each rank)."""

import pytest

from posttrain.distributed.worker_group_utils import merge_env_vars, rank_env_vars


def test_rank_env_vars_place_each_worker_in_the_group():
    """helper functions ... to consolidate settings for distributed worker groups: rank 5 of 8 with 4
    workers per node is local rank 1 on node 1."""
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


def test_caller_env_vars_add_and_override_threads_but_never_rewire_a_rank():
    """merging configuration options and dictionaries: the caller's variables are added (values as
    strings) and may change the thread count; RANK or MASTER_PORT from the caller is refused by name."""
    env = rank_env_vars(0, 1, 1, "127.0.0.1", 1234, 4, {"OMP_NUM_THREADS": 1, "NCCL_DEBUG": "INFO"})
    assert env["OMP_NUM_THREADS"] == "1" and env["NCCL_DEBUG"] == "INFO" and env["MKL_NUM_THREADS"] == "4"
    with pytest.raises(ValueError, match=r"\['MASTER_PORT', 'RANK'\]"):
        rank_env_vars(0, 1, 1, "127.0.0.1", 1234, 4, {"RANK": "3", "MASTER_PORT": "1"})
    assert merge_env_vars({"A": "1"}, None) == {"A": "1"}
