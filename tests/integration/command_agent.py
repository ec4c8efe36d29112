"""An agent as a command (`env.<task>.agent_command`), written as a user in any language would: the row as
JSON on stdin, the endpoint in OPENAI_BASE_URL, the reward as the last line printed. The row's
`ground_truth` picks a misbehaviour for the failure tests."""

import json
import sys
import time

import openai

row = json.load(sys.stdin)
kind = row.get("ground_truth")
if kind == "exit":
    print("the agent's sandbox is gone", file=sys.stderr)
    sys.exit(3)
reply = openai.OpenAI(max_retries=0).chat.completions.create(
    model="policy", messages=[{"role": "user", "content": row["prompt"]}], max_tokens=5
)
text = reply.choices[0].message.content
print(f"the model said {text!r}")  # earlier lines are the agent's own
if kind == "hang":
    time.sleep(60)
print("a reward" if kind == "garbage" else sum(c.isdigit() for c in text) / max(1, len(text)))
