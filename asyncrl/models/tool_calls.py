"""Tool-call formats of the model families asyncrl ships: how a model writes a call in
its text, how the text is read back into calls, and how tool schemas are described to
a model whose chat template does not render them.

    hermes  ``<tool_call>{"name": "calc", "arguments": {"expression": "3*4"}}</tool_call>``
            SmolLM2-Instruct (``model=smollm2``), Qwen2.5, Hermes: JSON inside tags
    calc    ``<calc>3*4</calc>``: the tiny model's calculator call (``env=calculator``),
            read as ``calc(expression="3*4")``

A format parses the text the model generated (special tokens left out) into the text
outside the calls, the calls, and one line per block that looked like a call but could
not be read (the runtime feeds those back to the model as tool errors).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: ``arguments`` decoded from its JSON."""

    id: str
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    def openai(self) -> dict[str, Any]:
        """OpenAI's ``tool_calls`` item (arguments as a JSON string)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}  # fmt: skip


@dataclass(frozen=True)
class Parsed:
    """A turn's text read by a format: ``content`` is the text outside the calls."""

    content: str
    calls: list[ToolCall]
    errors: list[str]  # blocks that looked like calls but could not be read


class ToolFormat(Protocol):
    name: str

    def parse(self, text: str) -> Parsed: ...

    def write(self, call: ToolCall) -> str: ...

    def describe(self, tools: list[dict]) -> str: ...


class HermesFormat:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks."""

    name = "hermes"
    BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def parse(self, text: str) -> Parsed:
        calls, errors, kept = [], [], text
        for m in self.BLOCK.finditer(text):
            try:
                obj = json.loads(m.group(1))
                name, args = obj["name"], obj.get("arguments", {})
                if isinstance(args, str):
                    args = json.loads(args)
                if not isinstance(name, str) or not isinstance(args, dict):
                    raise TypeError("name must be a string and arguments an object")
            except (ValueError, KeyError, TypeError) as e:
                errors.append(f"malformed tool call {m.group(0)[:80]!r}: {type(e).__name__}: {e}")
                continue
            calls.append(ToolCall(f"call_{len(calls)}", name, args))
            kept = kept.replace(m.group(0), "", 1)
        return Parsed(kept.strip() if calls else text, calls, errors)

    def write(self, call: ToolCall) -> str:
        body = json.dumps({"name": call.name, "arguments": call.arguments})
        return f"<tool_call>{body}</tool_call>"

    def describe(self, tools: list[dict]) -> str:
        lines = "\n".join(json.dumps(t.get("function", t)) for t in tools)
        return (
            "You may call these tools:\n<tools>\n" + lines + "\n</tools>\n"
            'To call one, write <tool_call>{"name": <tool name>, "arguments": {...}}'
            "</tool_call>; its result comes back in the next message."
        )


class CalcFormat:
    """``<calc>expr</calc>``: a call of ``calc`` with ``expression=expr``. The tiny
    model knows the tool from its warm start: no description is rendered."""

    name = "calc"
    BLOCK = re.compile(r"<calc>(.*?)</calc>", re.S)

    def parse(self, text: str) -> Parsed:
        calls = [ToolCall(f"call_{k}", "calc", {"expression": m.group(1)})
                 for k, m in enumerate(self.BLOCK.finditer(text))]  # fmt: skip
        errors = [] if calls or "<calc>" not in text else ["malformed tool call: no </calc>"]
        content = self.BLOCK.sub("", text).strip() if calls else text
        return Parsed(content, calls, errors)

    def write(self, call: ToolCall) -> str:
        return f"<calc>{call.arguments.get('expression', '')}</calc>"

    def describe(self, tools: list[dict]) -> str:
        return ""


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HermesFormat(), CalcFormat())}
HERMES = FORMATS["hermes"]


def tool_format(name: str, key: str = "env.tool_format") -> ToolFormat:
    """The format ``name`` (a ValueError naming ``key`` if unknown)."""
    if name not in FORMATS:
        raise ValueError(f"{key}={name!r}: unknown tool-call format (known: {', '.join(FORMATS)})")
    return FORMATS[name]
