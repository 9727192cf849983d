"""``env=calculator``: products of 2-digit numbers, which the tiny model cannot work out
in its head but can get by calling a calculator and copying its result.

    prompt   [header]37*48=
    turn 1   <calc>37*48</calc><eos>        (generated, trained)
    observe  =1776                          (the tool's output, never trained)
    turn 2   1776<eos>                      (generated: the final answer, scored)

``header`` is a fixed instruction before every prompt (conf/task/calculator.yaml). Its
other job: the prefix cache reuses whole KV blocks (32 tokens on vLLM-CPU), and without
it an episode computes fewer than 32 tokens before its second turn, so nothing is
reused; with a header of 32 characters or more every request reads the header's block
from the cache, and turn 2 reads turn 1's.

The reward is exact match of the final turn's text (digits only, one answer); a
malformed call or more than ``max_calls`` calls ends the episode with reward 0.
With ``tool_latency_median_ms`` > 0 each call's answer comes after a latency drawn
from a lognormal of that median and ``tool_latency_p99_ms`` (asyncrl/envs/latency.py),
as from a remote search or code-execution service; the draws are seeded by
``tool_latency_seed``, the prompt and the episode's place in this process's order.
The warm start learns the format from :meth:`CalculatorTask.demonstration`, which
uses the tool in only ``tool_rate`` of the demonstrations (the others answer in one
turn, from the model's head): RL has the rest to learn.
"""

from __future__ import annotations

import itertools
import random
import re

from asyncrl.envs.base import StepResult
from asyncrl.envs.latency import ToolLatency
from asyncrl.envs.messages import Message, MessageStep, Opening, ToolEnv
from asyncrl.models.tool_calls import ToolCall, tool_format
from asyncrl.tasks.base import Prompt, Task

ALPHABET = "0123456789+*=<>/calc"
EXPRESSION = re.compile(r"\d{1,6}(?:[+*]\d{1,6}){1,3}")
CALL = re.compile(f"<calc>({EXPRESSION.pattern})</calc>")
MAX_VALUE_DIGITS = 12  # a result longer than this is refused (no runaway observations)
EPISODES = itertools.count()  # episodes reset in this process: each one's latency seed


def evaluate(expr: str) -> int:
    """``expr`` of non-negative integers, ``+`` and ``*`` (products first); no eval."""
    return sum(_product(term) for term in expr.split("+"))


def _product(term: str) -> int:
    out = 1
    for f in term.split("*"):
        out *= int(f)
    return out


class CalculatorTask:
    """``header`` + ``a*b*...=`` (``num_operands`` factors in [min_operand, max_operand]);
    the answer is the product."""

    def __init__(
        self,
        min_operand: int = 10,
        max_operand: int = 99,
        num_operands: int = 2,
        tool_rate: float = 0.5,
        header: str = "",
    ):
        if not 0 <= min_operand <= max_operand:
            raise ValueError(
                f"task.min_operand={min_operand}, task.max_operand={max_operand}: "
                "expected 0 <= min_operand <= max_operand"
            )
        if not 2 <= num_operands <= 4:
            raise ValueError(f"task.num_operands={num_operands}: expected 2 to 4")
        if not 0 <= tool_rate <= 1:
            raise ValueError(f"task.tool_rate={tool_rate}: expected a number in [0, 1]")
        self.min_operand = min_operand
        self.max_operand = max_operand
        self.num_operands = num_operands
        self.tool_rate = tool_rate
        self.header = str(header)

    @property
    def alphabet(self) -> str:
        return ALPHABET + self.header  # the tiny model's tokenizer: one token per character

    def sample(self, rng: random.Random) -> Prompt:
        xs = [rng.randint(self.min_operand, self.max_operand) for _ in range(self.num_operands)]
        expr = "*".join(map(str, xs))
        text = f"{self.header}{expr}="
        return Prompt(text=text, answer=str(_product(expr)), meta={"operands": xs})

    def reward(self, prompt: Prompt, completion: str) -> dict[str, float]:
        got = completion.strip()
        exact = float(got.isdigit() and got == prompt.answer)
        return {"reward": exact, "exact": exact, "format": float(got.isdigit())}

    def demonstration(self, prompt: Prompt, rng: random.Random) -> list[tuple[str, bool]]:
        """(text, trained) segments after the prompt for the tiny model's warm start: each
        trained segment is one policy turn (the warm start ends it with EOS), an
        untrained one the tool's output."""
        if rng.random() >= self.tool_rate:
            return [(prompt.answer, True)]  # in its head: rarely right for 2-digit products
        expr = "*".join(map(str, prompt.meta["operands"]))
        return [(f"<calc>{expr}</calc>", True), (f"={prompt.answer}", False), (prompt.answer, True)]


class CalculatorEnv:
    """Serves ``<calc>expr</calc>`` turns with ``=value`` observations; the first turn
    without a call is the final answer, scored by the task's reward."""

    def __init__(
        self,
        max_calls: int = 2,
        tool_latency_median_ms: float = 0.0,
        tool_latency_p99_ms: float = 0.0,
        tool_latency_seed: int = 0,
    ):
        if max_calls < 0:
            raise ValueError(f"env.max_calls={max_calls}: expected >= 0")
        self.max_calls = max_calls
        self.latency = ToolLatency(tool_latency_median_ms, tool_latency_p99_ms, "env.tool_latency")
        self.latency_seed = tool_latency_seed
        self.rng = random.Random(tool_latency_seed)
        self.calls = 0
        self.sample: Prompt | None = None
        self.task: Task | None = None

    async def reset(self, sample: Prompt, task: Task) -> None:
        self.sample, self.task, self.calls = sample, task, 0
        self.rng = random.Random(f"{self.latency_seed}/{sample.text}/{next(EPISODES)}")

    async def step(self, text: str, token_ids: list[int]) -> StepResult:
        text = text.strip()
        if "<calc>" not in text:  # the final answer
            out = self.task.reward(self.sample, text)
            info = {k: float(v) for k, v in out.items() if k != "reward"}
            info["tool_used"] = float(self.calls > 0)
            return StepResult(reward=float(out["reward"]), done=True, info=info)
        m = CALL.fullmatch(text)
        self.calls += 1
        if m is None or self.calls > self.max_calls:
            info = {"exact": 0.0, "format": 0.0, "tool_used": 1.0}
            return StepResult(done=True, tool_calls=int(m is not None), info=info)
        value = str(evaluate(m.group(1)))
        await self.latency.wait(self.rng)  # the service's answer time
        if len(value) > MAX_VALUE_DIGITS:
            return StepResult(done=True, tool_calls=1, info={"exact": 0.0, "tool_used": 1.0})
        return StepResult(observation=f"={value}", tool_calls=1)


CALC_TOOL = {"type": "function", "function": {
    "name": "calc", "description": "The value of a product or sum of integers, e.g. 37*48.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}  # fmt: skip


class CalculatorChatEnv(ToolEnv):
    """``env=calculator_chat``: the calculator in message form (asyncrl/envs/messages.py).
    The user message is the prompt; a ``calc`` call is answered by a tool message with
    its value (an ``error: ...`` one for an expression it cannot read); the first turn
    without a call is the final answer, scored by the task's reward. More than
    ``max_calls`` calls end the episode with reward 0.

    With the tiny model (``tool_format: calc`` and conf/env/calculator_chat.yaml's
    template) the token sequence is the text env's: ``37*48=`` ``<calc>37*48</calc>``
    ``=1776`` ``1776``; with ``model=smollm2`` the calls are ``<tool_call>`` JSON and the
    turns ChatML."""

    tools = (CALC_TOOL,)

    def __init__(
        self,
        max_calls: int = 2,
        system: str = "",  # a system message before the prompt ("": none)
        tool_format: str = "calc",
        chat_template: str | None = None,
        turn_split: str = "history",
        examples: list[str] | tuple[str, ...] = (),  # worked examples before the prompt
    ):
        super().__init__(tool_format, chat_template, turn_split)
        if max_calls < 0:
            raise ValueError(f"env.max_calls={max_calls}: expected >= 0")
        bad = [e for e in examples if not EXPRESSION.fullmatch(str(e))]
        if bad:
            raise ValueError(f"env.examples: {bad[0]!r} is not integers joined by + or *")
        self.max_calls, self.system, self.calls = max_calls, system, 0
        self.examples = [str(e) for e in examples]
        self.sample: Prompt | None = None
        self.task: Task | None = None

    async def reset(self, sample: Prompt, task: Task) -> Opening:
        self.sample, self.task, self.calls = sample, task, 0
        messages = [Message("system", self.system)] if self.system else []
        header = getattr(task, "header", "")
        for expr in self.examples:
            messages += self.worked(f"{header}{expr}=", expr)
        return Opening([*messages, Message("user", sample.text)], list(self.tools))

    def worked(self, question: str, expr: str) -> list[Message]:
        """One worked example as chat turns: the question, a call written in the env's
        tool format (the model's own turn is its text, as the runtime renders it), the
        tool's answer, the value as the final answer."""
        value = self.calc(expr)
        call = tool_format(self.chat.tool_format).write(
            ToolCall("call_0", "calc", {"expression": expr})
        )
        return [Message("user", question), Message("assistant", call),
                Message("tool", value, tool_call_id="call_0", name="calc"),
                Message("assistant", value)]  # fmt: skip

    def calc(self, expression: str) -> str:
        if not EXPRESSION.fullmatch(str(expression)):
            raise ValueError(f"expected integers joined by + or *, got {expression!r}")
        value = str(evaluate(expression))
        if len(value) > MAX_VALUE_DIGITS:
            raise ValueError(f"the result has more than {MAX_VALUE_DIGITS} digits")
        return value

    async def step(self, message: Message) -> MessageStep:
        self.calls += len(message.tool_calls) + len(message.errors)
        if self.calls > self.max_calls:
            info = {"exact": 0.0, "format": 0.0, "tool_used": 1.0}
            return MessageStep(done=True, tool_calls=len(message.tool_calls), info=info)
        return await super().step(message)

    async def answer(self, message: Message) -> MessageStep:
        out = self.task.reward(self.sample, message.content)
        info = {k: float(v) for k, v in out.items() if k != "reward"}
        info["tool_used"] = float(self.calls > 0)
        return MessageStep(reward=float(out["reward"]), done=True, info=info)
