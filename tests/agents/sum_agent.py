"""A black-box agent: only the `openai` client and the standard library.

Answers an addition prompt (ASYNCRL_PROMPT, e.g. "12+7=") in a loop of its own: asks,
feeds back a "=" turn, asks again (a check the reward ignores), then prints
{"reward": 1 if its first answer is the sum}.
AGENT_MODE (read from its environment) picks a behaviour the tests need:
  plain    two calls on one growing history (the first with logprobs=True)
  rewrite  a third call after dropping the first exchange from the history (a fork)
  crash    raises after its first call
  hang     sleeps after its first call
"""

import asyncio
import json
import os
import time

from openai import AsyncOpenAI


async def main() -> None:
    mode = os.environ.get("AGENT_MODE", "plain")
    prompt = os.environ["ASYNCRL_PROMPT"]
    client = AsyncOpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    history = [{"role": "user", "content": prompt}]
    first = await client.chat.completions.create(
        model="policy", messages=history, max_tokens=4, logprobs=True
    )
    history.append({"role": "assistant", "content": first.choices[0].message.content or ""})
    if mode == "crash":
        raise RuntimeError("the agent crashed on purpose")
    if mode == "hang":
        time.sleep(3600)
    history.append({"role": "user", "content": "="})
    second = await client.chat.completions.create(model="policy", messages=history, max_tokens=4)
    answer = first.choices[0].message.content or ""
    assert second.choices[0].message.role == "assistant"
    if mode == "rewrite":  # a summarising agent: forget the first exchange
        history = [{"role": "user", "content": prompt + "="}]
        await client.chat.completions.create(model="policy", messages=history, max_tokens=4)
    a, b = prompt.rstrip("=").split("+")
    print(
        json.dumps(
            {"reward": float(answer.strip() == str(int(a) + int(b))), "info": {"calls": 2.0}}
        )
    )


asyncio.run(main())
