"""posttrain across hosts that each have their own network address, and the loss of one of them: three
network namespaces (a head of 2 CPUs and two workers of 1) joined by veth pairs to a bridge in a fourth,
with addresses this test assigns (10.231.0.1-3, reachable only inside the namespaces), a Ray node started
in each with token authentication, and `posttrain grpo` run on the head: asynchronous, the policy's two
workers on two hosts (STRICT_SPREAD), its generation worker apart. Mid-run every process of one worker
host is killed; the run notices, rebuilds on the hosts left and finishes with exit status 0. Before that,
a run whose log directory the worker hosts cannot see (each has its own disk mounted there) stops with an
error naming the host, and `posttrain sft` with one worker on each of two hosts runs to the end with the
losses of a one-node run. Skipped, saying why, where namespaces cannot be made (not root, no `ip`)."""

import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from run_logs import metrics_by_step
from test_sft import run_sft
from test_sft import tiny_overrides as sft_overrides
from tiny_model import tiny_from_config

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SUBNET = "10.231.0"
NAMES = ("head", "w1", "w2")
CPUS = (2, 1, 1)  # per host


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
        self.unshared_dir = temp_dir / "unshared"  # the worker hosts each see their own empty directory here

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
        # Each host its own temp dir, as on separate machines: nodes sharing one race for socket names.
        common = ["--block"]
        head = [
            ray,
            "start",
            "--head",
            f"--node-ip-address={self.ip(0)}",
            "--port=6379",
            f"--num-cpus={CPUS[0]}",
        ]
        head += ["--include-dashboard=false", f"--temp-dir={self.temp_dir / NAMES[0]}", *common]
        self.nodes.append(subprocess.Popen(self.in_namespace(0, *head), env=self.env, start_new_session=True))
        self.wait_for_port(0, 6379)
        self.unshared_dir.mkdir(parents=True, exist_ok=True)
        for index in range(1, len(NAMES)):
            worker = [ray, "start", f"--address={self.ip(0)}:6379", f"--node-ip-address={self.ip(index)}"]
            worker += [f"--num-cpus={CPUS[index]}", f"--temp-dir={self.temp_dir / NAMES[index]}", *common]
            # `ip netns exec` gives the host a mount namespace of its own: a tmpfs mounted there over
            # unshared_dir hides the head's files in it from this host only, as an unshared disk would.
            hide = f"mount -t tmpfs none {shlex.quote(str(self.unshared_dir))} && exec {shlex.join(worker)}"
            self.nodes.append(
                subprocess.Popen(
                    self.in_namespace(index, "sh", "-c", hide), env=self.env, start_new_session=True
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

    def kill_host(self, index: int) -> None:
        """Every process of host `index` (its Ray node and the workers on it), killed at once."""
        for pid in run("ip", "netns", "pids", self.namespaces[index], check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        """Kill the Ray nodes (every process inside the namespaces, which this test started, by pid; then
        the `ray start` processes), then delete the namespaces."""
        for index in range(len(self.namespaces)):
            self.kill_host(index)
        for process in self.nodes:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=15)
        for ns in [*self.namespaces, self.hub]:
            run("ip", "netns", "del", ns, check=False)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """One set of hosts for the module's tests (the last one kills a host)."""
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    token = tmp_path_factory.mktemp("hosts") / "ray_token"
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
        built.wait_for_nodes(len(NAMES))
        yield built
    finally:
        built.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_a_run_directory_a_host_cannot_see_is_an_error_naming_the_host(hosts):
    """`posttrain sft` with its log directory where the worker hosts see a disk of their own stops before
    training with SharedDirectoryError naming a worker host's address and the config key."""
    cli = [sys.executable, "-m", "posttrain.cli", "sft", "--config", str(REPO / "configs" / "sft_tiny.yaml")]
    cli += [
        f"logger.log_dir={hosts.unshared_dir / 'sft'}",
        f"cluster.address={hosts.ip(0)}:6379",
        "cluster.num_nodes=2",
        "cluster.num_cpus_per_worker=1",
        "cluster.placement_strategy=STRICT_SPREAD",
    ]
    done = subprocess.run(
        hosts.in_namespace(0, *cli), env=hosts.env, cwd=REPO, capture_output=True, text=True, timeout=180
    )
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-4000:]
    assert "SharedDirectoryError" in output and "cannot share logger.log_dir=" in output, output[-4000:]
    assert re.search(rf"\(({re.escape(hosts.ip(1))}|{re.escape(hosts.ip(2))})\) cannot share", output)
    assert not (hosts.unshared_dir / "sft" / "metrics.jsonl").exists()


def test_sft_across_hosts_runs_to_the_end_with_the_losses_of_one_node(hosts, ray_session, tmp_path):
    """`posttrain sft` on the head with one worker on each of two hosts (STRICT_SPREAD, 1 CPU each)
    finishes with exit status 0, exports its model, and logs at every step the loss of the same run with
    both workers on one node (the tests' local Ray instance)."""
    settings = {"sft.max_num_steps": 4, "sft.val_period": 1000}
    one_node = run_sft(tmp_path / "one", **settings, **{"cluster.workers_per_node": 2})
    across = {
        "cluster.address": f"{hosts.ip(0)}:6379",
        "cluster.num_nodes": 2,
        "cluster.num_cpus_per_worker": 1,
        "cluster.placement_strategy": "STRICT_SPREAD",
    }
    cli = [sys.executable, "-m", "posttrain.cli", "sft", "--config", str(REPO / "configs" / "sft_tiny.yaml")]
    cli += sft_overrides(tmp_path / "two", **settings, **across)
    done = subprocess.run(
        hosts.in_namespace(0, *cli), env=hosts.env, cwd=REPO, capture_output=True, text=True, timeout=240
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-8000:]
    placed = [line for line in output.splitlines() if line.startswith("policy: ")][-1]
    assert len(set(re.findall(r"rank \d+ on ([\d.]+)", placed))) == 2, placed
    assert (tmp_path / "two" / "hf_model" / "config.json").exists()
    two = metrics_by_step(tmp_path / "two")
    assert sorted(one_node) == [1, 2, 3, 4]
    for step, loss in one_node.items():
        assert two[step]["train/loss"] == pytest.approx(loss, abs=1e-5), step


def test_async_grpo_across_hosts_survives_the_loss_of_one(hosts, tmp_path):
    """Steps 1-5, a checkpoint after each; once step 2 is logged, the worker host of a policy worker (as
    the driver prints where each rank runs) is killed. The run names the lost node, places the workers on
    the hosts left, resumes from its latest checkpoint, and every step's sampled tokens score the same
    under the trainer as under the generation worker that sampled them."""
    log_dir = tmp_path / "grpo"
    overrides = {
        "logger.log_dir": log_dir,
        "logger.tensorboard_enabled": "false",
        "policy.model_name": "null",
        "policy.model.from_config": tiny_from_config(seed=3),
        "grpo.max_num_steps": 5,
        "grpo.num_prompts_per_step": 4,
        "grpo.num_generations_per_prompt": 4,
        "grpo.val_at_start": "false",
        "grpo.val_period": 0,
        "grpo.async_grpo.enabled": "true",
        "grpo.async_grpo.max_trajectory_age_steps": 0,
        "generation.colocated": "false",
        "generation.num_cpus_per_worker": 1,
        "policy.train_global_batch_size": 16,
        "policy.train_micro_batch_size": 8,
        "data.num_train": 64,
        "data.num_val": 8,
        "+env.arithmetic.num_cpus": 0,
        "checkpointing.save_period": 1,
        "cluster.address": f"{hosts.ip(0)}:6379",
        "cluster.num_nodes": 2,
        "cluster.num_cpus_per_worker": 1,
        "cluster.placement_strategy": "STRICT_SPREAD",
        "cluster.max_restarts": 1,
    }
    cli = [
        sys.executable,
        "-m",
        "posttrain.cli",
        "grpo",
        "--config",
        str(REPO / "configs" / "grpo_tiny.yaml"),
    ]
    cli += [f"{key}={value}" for key, value in overrides.items()]
    driver = subprocess.Popen(
        hosts.in_namespace(0, *cli),
        env=hosts.env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(driver.stdout), daemon=True)
    reader.start()
    killed = None
    deadline = time.monotonic() + 300
    while driver.poll() is None and time.monotonic() < deadline:
        if killed is None and 2 in metrics_by_step_if_any(log_dir):
            killed = policy_worker_host(hosts, lines)
            hosts.kill_host(killed)
        time.sleep(0.2)
    if driver.poll() is None:
        driver.kill()
    driver.wait()
    reader.join(timeout=10)
    output = "".join(lines)
    assert killed and driver.returncode == 0, output[-8000:]
    assert "lost node(s): " in output and "restart 1 of 1" in output, output[-8000:]
    steps = metrics_by_step(log_dir)
    assert all(step in steps for step in range(1, 6))
    for step in range(1, 6):
        assert 1.0 - 1e-6 <= steps[step]["train/token_mult_prob_error"] <= 1.01, (
            step,
            steps[step],
        )  # a mean of values >= 1, in float32
    assert (log_dir / "hf_model" / "config.json").exists()


def policy_worker_host(hosts: Hosts, lines: list[str]) -> int:
    """The index of a worker host (not the head) that runs a policy rank, from the driver's line
    `policy: 2 workers on 2 nodes: rank 0 on IP, rank 1 on IP`."""
    placed = [line for line in list(lines) if line.startswith("policy: ")][-1]
    ips = re.findall(r"rank \d+ on ([\d.]+)", placed)
    return next(index for index in range(1, len(NAMES)) if hosts.ip(index) in ips)


def metrics_by_step_if_any(log_dir: Path) -> dict[int, dict]:
    """The run's metrics so far (none before its first step is logged)."""
    if not (log_dir / "metrics.jsonl").exists():
        return {}
    try:
        return metrics_by_step(log_dir)
    except ValueError:  # a line being written
        return {}
