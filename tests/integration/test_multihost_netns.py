"""posttrain across hosts that each have their own network address: three network namespaces (a head and
two workers) joined by veth pairs to a bridge in a fourth, with addresses this test assigns
(10.231.0.1-3, reachable only inside the namespaces), a Ray node started in each with token
authentication, and `posttrain sft` then `posttrain grpo` (from the SFT model) run on the head with
`cluster.num_nodes=2`. Skipped, saying why, where namespaces cannot be made (not root, no `ip`)."""

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from run_logs import metrics_by_step

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SUBNET = "10.231.0"
NAMES = ("head", "w1", "w2")


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, check=check)


def namespaces_unavailable() -> str | None:
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"ptprobe{os.getpid()}"
    made = run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    run("ip", "netns", "del", probe, check=False)
    return None


class Hosts:
    """The namespaces, links and Ray nodes of the test; `close` removes all of them."""

    def __init__(self, tag: str, temp_dir: Path, env: dict[str, str]) -> None:
        self.tag, self.temp_dir, self.env = tag, temp_dir, env
        self.hub = f"{tag}hub"
        self.namespaces = [f"{tag}{name}" for name in NAMES]
        self.nodes: list[subprocess.Popen] = []

    def ip(self, index: int) -> str:
        return f"{SUBNET}.{index + 1}"

    def build_network(self) -> None:
        run("ip", "netns", "add", self.hub)
        run("ip", "netns", "exec", self.hub, "ip", "link", "add", "br0", "type", "bridge")
        run("ip", "netns", "exec", self.hub, "ip", "link", "set", "br0", "up")
        for index, ns in enumerate(self.namespaces):
            run("ip", "netns", "add", ns)
            inside, outside = f"{self.tag}e{index}", f"{self.tag}b{index}"
            run("ip", "link", "add", inside, "type", "veth", "peer", "name", outside)
            run("ip", "link", "set", inside, "netns", ns)
            run("ip", "link", "set", outside, "netns", self.hub)
            run("ip", "netns", "exec", self.hub, "ip", "link", "set", outside, "master", "br0", "up")
            run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.ip(index)}/24", "dev", inside)
            run("ip", "netns", "exec", ns, "ip", "link", "set", inside, "up")
            run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")

    def in_namespace(self, index: int, *command: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[index], *command]

    def start_ray(self) -> None:
        ray = str(Path(sys.executable).parent / "ray")
        common = ["--num-cpus=1", f"--temp-dir={self.temp_dir}", "--block"]
        head = [ray, "start", "--head", f"--node-ip-address={self.ip(0)}", "--port=6379"]
        head += ["--include-dashboard=false", *common]
        self.nodes.append(subprocess.Popen(self.in_namespace(0, *head), env=self.env, start_new_session=True))
        self.wait_for_port(0, 6379)
        for index in (1, 2):
            worker = [ray, "start", f"--address={self.ip(0)}:6379", f"--node-ip-address={self.ip(index)}"]
            self.nodes.append(
                subprocess.Popen(
                    self.in_namespace(index, *worker, *common), env=self.env, start_new_session=True
                )
            )

    def wait_for_port(self, index: int, port: int, timeout_s: float = 60) -> None:
        """Until something listens on `port` of host `index` (asked from inside its namespace)."""
        script = f"import socket; socket.create_connection(('{self.ip(index)}', {port}), timeout=1).close()"
        deadline = time.monotonic() + timeout_s
        while subprocess.run(
            self.in_namespace(index, sys.executable, "-c", script), capture_output=True
        ).returncode:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {self.ip(index)}:{port} after {timeout_s:g}s")
            time.sleep(0.5)

    def wait_for_nodes(self, count: int, timeout_s: float = 60) -> None:
        script = f"import ray; ray.init(address='{self.ip(0)}:6379'); print(len(ray.nodes()))"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = subprocess.run(
                self.in_namespace(0, sys.executable, "-c", script),
                env=self.env,
                capture_output=True,
                text=True,
            )
            if found.stdout.strip().isdigit() and int(found.stdout.strip()) >= count:
                return
            time.sleep(1)
        raise TimeoutError(f"{count} Ray nodes did not join within {timeout_s:g}s")

    def close(self) -> None:
        """Kill the Ray nodes (every process inside the namespaces, which this test started, by pid; then
        the `ray start` processes), then delete the namespaces."""
        for ns in self.namespaces:
            for pid in run("ip", "netns", "pids", ns, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for process in self.nodes:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=15)
        for ns in [*self.namespaces, self.hub]:
            run("ip", "netns", "del", ns, check=False)


@pytest.fixture
def hosts(tmp_path):
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    token = tmp_path / "ray_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "TOKENIZERS_PARALLELISM": "false",
    }
    env.pop("RAY_ADDRESS", None)
    temp_dir = Path(f"/tmp/ptn{os.getpid()}")  # short: Ray's socket paths live under it
    built = Hosts(f"pt{os.getpid() % 100000}", temp_dir, env)
    try:
        built.build_network()
        built.start_ray()
        built.wait_for_nodes(3)
        yield built
    finally:
        built.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def posttrain(hosts: Hosts, command: str, config: str, *overrides: str) -> None:
    cli = [sys.executable, "-m", "posttrain.cli", command, "--config", str(REPO / "configs" / config)]
    cluster = [f"cluster.address={hosts.ip(0)}:6379", "cluster.num_nodes=2", "cluster.num_cpus_per_worker=1"]
    done = subprocess.run(
        hosts.in_namespace(0, *cli, *cluster, *overrides),
        env=hosts.env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def test_sft_then_grpo_across_hosts_with_their_own_addresses(hosts, tmp_path):
    sft_dir, grpo_dir = tmp_path / "sft", tmp_path / "grpo"
    posttrain(
        hosts,
        "sft",
        "sft_tiny.yaml",
        f"logger.log_dir={sft_dir}",
        "logger.tensorboard_enabled=false",
        "policy.model.from_config.hidden_size=64",
        "policy.model.from_config.num_layers=2",
        "policy.train_global_batch_size=16",
        "policy.train_micro_batch_size=8",
        "sft.max_num_steps=3",
        "sft.val_period=3",
        "sft.val_max_samples=16",
        "data.num_train=200",
        "data.num_val=16",
        "checkpointing.enabled=false",
    )
    assert sorted(step for step, m in metrics_by_step(sft_dir).items() if "train/loss" in m) == [1, 2, 3]
    posttrain(
        hosts,
        "grpo",
        "grpo_tiny.yaml",
        f"policy.model_name={sft_dir / 'hf_model'}",
        f"logger.log_dir={grpo_dir}",
        "grpo.max_num_steps=2",
        "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=4",
        "grpo.val_at_start=false",
        "grpo.val_period=0",
        "policy.train_global_batch_size=16",
        "policy.train_micro_batch_size=8",
        "data.num_train=64",
        "data.num_val=8",
        "checkpointing.enabled=false",
    )
    steps = metrics_by_step(grpo_dir)
    for step in (1, 2):
        assert 1.0 <= steps[step]["train/token_mult_prob_error"] <= 1.01
    assert (grpo_dir / "hf_model" / "config.json").exists()
