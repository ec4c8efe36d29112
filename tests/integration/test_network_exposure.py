"""A local cluster started the way `posttrain` starts one listens on the loopback interface only: GCS,
raylet, object manager, workers, agents, and the torch.distributed rendezvous of a worker group. Run in
a fresh process with the default ClusterConfig (the dashboard agent's HTTP server off)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import json, os, psutil, torch
import torch.distributed as dist
from posttrain.distributed import ClusterConfig, RayVirtualCluster, RayWorkerGroup, init_torch_distributed

class Worker:
    def all_reduce(self):
        init_torch_distributed()
        value = torch.ones(1)
        dist.all_reduce(value)
        return value.item(), os.getpid()

    def sockets(self):  # while its process group is alive
        return [(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("inet")
                if c.status == psutil.CONN_LISTEN]

cluster = RayVirtualCluster(ClusterConfig(workers_per_node=2, num_cpus_per_worker=0.5))
group = RayWorkerGroup(cluster, Worker)
import ray
from ray._raylet import AuthenticationMode, get_authentication_mode
totals = group.run_all("all_reduce")
worker_sockets = group.run_all("sockets")
driver = psutil.Process()
listening = []
for process in [driver, *driver.children(recursive=True)]:
    try:
        listening += [(process.name(), c.laddr.ip, c.laddr.port) for c in process.net_connections("inet")
                      if c.status == psutil.CONN_LISTEN]
    except psutil.NoSuchProcess:
        pass
print(json.dumps({
    "totals": [t for t, _ in totals], "worker_sockets": worker_sockets, "listening": listening,
    "node_ip": ray.nodes()[0]["NodeManagerAddress"], "token_auth": get_authentication_mode() ==
    AuthenticationMode.TOKEN,
}))
cluster.shutdown()
"""


def is_loopback(ip: str) -> bool:
    return ip.startswith("127.") or ip == "::1" or ip.startswith("::ffff:127.")


def test_local_cluster_and_rendezvous_listen_on_loopback_only_with_token_auth(tmp_path):
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["totals"] == [2.0, 2.0]  # the gloo group works over loopback
    assert report["node_ip"] == "127.0.0.1" and report["token_auth"]
    names = {name for name, _, _ in report["listening"]}
    assert {"gcs_server", "raylet"} <= names and len(report["listening"]) >= 5, report["listening"]
    exposed = [entry for entry in report["listening"] if not is_loopback(entry[1])]
    exposed += [
        entry for sockets in report["worker_sockets"] for entry in sockets if not is_loopback(entry[0])
    ]
    assert exposed == [], f"listening on a non-loopback address: {exposed}"
    agent_http = [entry for entry in report["listening"] if entry[2] == 52365]
    assert agent_http == [], "the dashboard agent's HTTP server (job API) runs though it was not asked for"
