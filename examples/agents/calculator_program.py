"""The calculator agent as a separate program, for `env.<task>.agent_command` (any language works the same
way): the row as JSON on stdin, the episode's endpoint in OPENAI_BASE_URL and OPENAI_API_KEY, plain HTTP
(no SDK), the reward printed as the last line. Its two turns are calculator_agent.py's."""

import json
import os
import sys
import urllib.request

from calculator_agent import CALL, EXAMPLE, SYSTEM, calculate, last_number


def complete(messages: list[dict], max_tokens: int) -> str:
    """One chat completion from the episode's endpoint: the reply's text."""
    body = json.dumps({"model": "policy", "messages": messages, "max_tokens": max_tokens}).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}
    url = os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions"
    request = urllib.request.Request(url, body, headers)
    with urllib.request.urlopen(request) as response:
        return json.load(response)["choices"][0]["message"]["content"] or ""


row = json.load(sys.stdin)
question = row["prompt"].replace(" Reply with the number only.", "")
messages = [{"role": "system", "content": SYSTEM}, *EXAMPLE, {"role": "user", "content": question}]
text = complete(messages, 24)
call = CALL.search(text)
follow_up = f"The calculator says: {calculate(call.group(1))}. " if call else ""
messages += [
    {"role": "assistant", "content": text},
    {"role": "user", "content": follow_up + "Reply with the number only."},
]
final = complete(messages, 12)
print(float(last_number(final) == str(row["ground_truth"])))
