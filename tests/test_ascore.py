"""tasks.base.ascore: a task that grades elsewhere (``areward``) is awaited on the event
loop, never called inline; a plain task's ``reward`` is called directly; either one's
crash is a recorded error, never raised."""

from __future__ import annotations

import asyncio
import threading

from asyncrl.tasks.base import Prompt, ascore

PROMPT = Prompt("1+1=", "2")


class Plain:
    def reward(self, prompt, completion):
        return {"reward": float(completion == prompt.answer), "exact": 1.0}


class Awaited:
    """``reward`` would block its caller; ``areward`` yields to the loop while it waits."""

    def __init__(self):
        self.loop_threads: set[int] = set()

    def reward(self, prompt, completion):
        raise AssertionError("reward called inline on the event loop")

    async def areward(self, prompt, completion):
        self.loop_threads.add(threading.get_ident())
        await asyncio.sleep(0.05)
        return {"reward": float(completion == prompt.answer)}


class Broken:
    async def areward(self, prompt, completion):
        raise ValueError("grader gone")


def test_plain_tasks_are_called_and_awaited_tasks_awaited():
    async def main():
        task = Awaited()
        ticks = 0

        async def ticker():  # the loop stays free while four gradings wait
            nonlocal ticks
            for _ in range(5):
                await asyncio.sleep(0.01)
                ticks += 1

        got = await asyncio.gather(
            ticker(), *(ascore(task, PROMPT, t) for t in ("2", "3", "2", "x"))
        )
        return got[1:], ticks, task.loop_threads

    scored, ticks, threads = asyncio.run(main())
    assert [s[0] for s in scored] == [1.0, 0.0, 1.0, 0.0] and all(s[2] == "" for s in scored)
    assert ticks == 5 and threads == {threading.get_ident()}
    assert asyncio.run(ascore(Plain(), PROMPT, "2")) == (1.0, {"exact": 1.0}, "")


def test_a_grader_that_raises_is_a_recorded_error():
    reward, breakdown, err = asyncio.run(ascore(Broken(), PROMPT, "2"))
    assert (reward, breakdown) == (0.0, {}) and err == "ValueError: grader gone"
