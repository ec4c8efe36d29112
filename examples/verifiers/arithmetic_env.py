"""A verifiers 0.4.0 environment for posttrain's built-in `arithmetic` data (`07+85=` -> `092`): a task is a
prompt and its answer, the reward is 1 when the reply is the answer. Train on it with
`env.arithmetic.verifiers: examples/verifiers/arithmetic_env.py` (docs/bring-your-environment.md)."""

import verifiers.v1 as vf


class ArithmeticData(vf.TaskData):
    answer: str
    """The zero-padded sum."""


class ArithmeticTask(vf.Task[ArithmeticData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)


class ArithmeticTaskset(vf.Taskset[ArithmeticTask, vf.TasksetConfig]):
    def load(self) -> list[ArithmeticTask]:
        sums = [(a, b) for a in range(100) for b in range(100)]
        return [
            ArithmeticTask(ArithmeticData(prompt=f"{a:02d}+{b:02d}=", answer=f"{a + b:03d}")) for a, b in sums
        ]


__all__ = ["ArithmeticTaskset"]
