"""A verifiers 0.4.0 environment written as its users write one (a `TaskData` type, a `Task` with a
`@vf.reward`, a `Taskset` exported through `__all__`), for the verifiers-environment tests. Its reward
records what it scored, so that a test can compare it with what posttrain trained on."""

import verifiers.v1 as vf

SCORED: dict[tuple[str, str], float] = {}  # (prompt, the reply the reward read) -> the reward


def score(reply: str, answer: str) -> float:
    """1 for a reply holding the answer, else partial credit for brevity."""
    return 1.0 if answer in reply else 1.0 / (1 + len(reply))


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        if self.data.answer == "raise":
            raise ValueError("the scorer crashed on this task")
        reward = score(trace.last_reply, self.data.answer)
        SCORED[(self.data.prompt, trace.last_reply)] = reward
        return reward


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self) -> list[SumTask]:
        return [SumTask(SumData(prompt=f"{i}+1=", answer=str(i + 1)), self.config.task) for i in range(4)]


__all__ = ["SumTaskset"]
