"""examples/agents/calculator_agent.py against a scripted client: a `CALC:` reply is evaluated by the agent
and fed back, the reward is the final reply's last number against the row's answer, and an expression
the agent's calculator does not take comes back as an error the model reads."""

import asyncio
import importlib.util
from types import SimpleNamespace

spec = importlib.util.spec_from_file_location("calculator_agent", "examples/agents/calculator_agent.py")
agent = importlib.util.module_from_spec(spec)
spec.loader.exec_module(agent)


class ScriptedClient:
    """Answers each chat completion with the next scripted reply; keeps the messages it was sent."""

    def __init__(self, replies: list[str]):
        self.replies, self.sent = list(replies), []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    async def create(self, model: str, messages: list[dict], max_tokens: int):
        self.sent.append([dict(m) for m in messages])
        message = SimpleNamespace(content=self.replies.pop(0))
        return SimpleNamespace(choices=[SimpleNamespace(message=message)])


def play(replies: list[str], answer: str) -> tuple[float, ScriptedClient]:
    client = ScriptedClient(replies)
    row = {"prompt": "What is 51 minus 29? Reply with the number only.", "ground_truth": answer}
    return asyncio.run(agent.solve(client, row)), client


def test_a_calculator_call_is_run_and_its_result_fed_back():
    reward, client = play(["CALC: 51 - 29", "The answer is 22"], "22")
    assert reward == 1.0
    assert client.sent[1][-1]["content"] == "The calculator says: 22. Reply with the number only."
    assert client.sent[0][-1]["content"] == "What is 51 minus 29?"


def test_the_reward_is_the_final_numbers_match_whatever_the_calculator_was_asked():
    assert play(["CALC: 89", "89"], "22")[0] == 0.0  # the model asked for its own number
    reward, client = play(["51 minus 29 is 22", "22"], "22")  # no call: asked for the number directly
    assert reward == 1.0 and client.sent[1][-1]["content"] == "Reply with the number only."
    assert agent.calculate("2 ** 10").startswith("error:") and agent.calculate("(3 + 4) * 5") == "35"
