"""An agent as a separate program, for the agent-environment tests: the row as JSON on stdin, the episode's
endpoint in OPENAI_BASE_URL / OPENAI_API_KEY (read by the `openai` client itself), the reward printed last.
By the row's `ground_truth`: `ok` asks once and prints 1 with the reply's token count, `exit` fails with a
message on stderr, `junk` prints no number."""

import json
import sys

import openai

row = json.load(sys.stdin)
client = openai.OpenAI(max_retries=0)
reply = client.chat.completions.create(
    model="policy", messages=[{"role": "user", "content": row["prompt"]}], max_tokens=4
)
if row["ground_truth"] == "exit":
    sys.exit(f"the agent program gave up on {row['prompt']!r}")
print("a log line the reward follows")
print("done" if row["ground_truth"] == "junk" else 1.0 + len(reply.choices[0].model_extra["token_ids"]))
