"""The message-level environment contract, beside the text one (asyncrl/envs/base.py): an
env that speaks chat messages (system / user / assistant / tool, with tool schemas)
instead of raw text. The runtime renders them with the model's chat template
(asyncrl/envs/chat_turns.py) and keeps the token sequence exact::

    env = MyChatEnv(**kwargs)                     # a ChatEnv: one object per episode
    opening = await env.reset(sample, task)       # Opening(messages, tools): the prompt,
                                                  #   rendered with the generation prompt
    loop, up to env.max_turns:
        the policy's turn                         (the engine's ids, trained on)
        step = await env.step(Message("assistant", content, tool_calls))
                                                  # tool calls parsed by env.tool_format
        step.messages rendered, appended          (tool results, a user turn: mask 0)
    await env.close()                             # optional

A message may show images: its ``content`` is then a list of parts, text (``str``) and
:class:`ImagePart` (PNG bytes) in the order they read; the template renders each image
part as the model's image placeholder, and the images go to the engine and the
trajectory as a text env's observation images do (docs/vision.md). A text-only message
keeps a ``str`` content. An env whose messages show images sets ``shows_images``: a
model whose processor takes no images is then refused at start-up.

``ChatEnv`` holds what the runtime needs from the env's config: ``tool_format`` (how the
model writes calls: asyncrl/models/tool_calls.py), ``chat_template`` (None: the model's
own) and ``turn_split`` (``history``: each new segment is the full render of the history
past what was already sent, and the driver refuses a template that is not append-only
for the model; ``delta``: each segment is rendered after a fixed one-exchange context,
for templates that rewrite earlier turns). ``ToolEnv`` runs the calls against its
methods and answers each with a tool message; a call it cannot run (unknown tool, bad
arguments, a tool that raises, a block that does not parse) is answered with an
``error: ...`` tool message and the episode goes on. A tool answers text, an
:class:`ImagePart`, or a list of parts (its tool message's content).

Reward, ``done``, ``info`` and ``tool_calls`` mean what they mean in StepResult.
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.models.tool_calls import ToolCall, tool_format
from asyncrl.tasks.base import Prompt, Task

ROLES = ("system", "user", "assistant", "tool")
TURN_SPLITS = ("history", "delta")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"  # how every PNG file begins


@dataclass(frozen=True)
class ImagePart:
    """An image in a message's content, where it stands among the text parts: its PNG
    bytes (``asyncrl.tasks.visual.png_bytes`` writes a PIL image)."""

    png: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.png, bytes) or not self.png.startswith(PNG_MAGIC):
            raise TypeError("an ImagePart holds an image's PNG bytes")


Part = str | ImagePart  # a content part: text, or an image


@dataclass
class Message:
    """One chat message. ``content``: text, or a list of text and image parts (in the
    order they read); ``tool_calls``: an assistant's parsed calls; ``tool_call_id`` and
    ``name``: which call a tool message answers."""

    role: str
    content: str | list[Part] = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None
    errors: list[str] = field(default_factory=list)  # an assistant's unreadable call blocks

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"message role {self.role!r}: expected one of {', '.join(ROLES)}")
        if isinstance(self.content, list):
            if not all(isinstance(p, Part) for p in self.content):
                raise TypeError(
                    f"a {self.role} message's content parts must be strings or ImageParts"
                )
        elif not isinstance(self.content, str):
            raise TypeError(f"a {self.role} message's content must be a string or a list of parts")

    @property
    def text(self) -> str:
        """The content's text parts, joined (the content itself when it is text)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(p for p in self.content if isinstance(p, str))

    @property
    def images(self) -> list[bytes]:
        """The PNG bytes of the content's image parts, in order."""
        if isinstance(self.content, str):
            return []
        return [p.png for p in self.content if isinstance(p, ImagePart)]

    def as_dict(self) -> dict[str, Any]:
        """The message as chat templates take it (OpenAI's chat format; a content with
        parts as ``{"type": "text", "text": ...}`` and ``{"type": "image"}`` entries,
        as Hugging Face's multimodal templates read them)."""
        content: Any = self.content
        if isinstance(content, list):
            content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image"}
                       for p in content]  # fmt: skip
        out: dict[str, Any] = {"role": self.role, "content": content}
        if self.tool_calls:
            out["tool_calls"] = [c.openai() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


@dataclass
class Opening:
    """What ``reset`` answers: the first messages and the tools' JSON schemas (OpenAI's
    ``{"type": "function", "function": {...}}``)."""

    messages: list[Message]
    tools: list[dict] = field(default_factory=list)


@dataclass
class MessageStep:
    """What the env answers to one assistant turn."""

    messages: list[Message] = field(default_factory=list)  # appended after the turn (mask 0)
    reward: float = 0.0
    done: bool = False
    tool_calls: int = 0
    info: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ChatOptions:
    """How the runtime renders a ChatEnv's messages (``env.tool_format``,
    ``env.chat_template``, ``env.turn_split``)."""

    tool_format: str = "hermes"
    chat_template: str | None = None  # a Jinja template; None: the model's own
    turn_split: str = "history"

    def __post_init__(self) -> None:
        tool_format(self.tool_format)
        if self.turn_split not in TURN_SPLITS:
            raise ValueError(
                f"env.turn_split={self.turn_split!r}: expected one of {', '.join(TURN_SPLITS)}"
            )


class ChatEnv:
    """Base of a message-level env: takes the rendering keys, leaves ``reset`` and
    ``step`` to the subclass (``reset(sample, task) -> Opening``,
    ``step(message) -> MessageStep``). ``shows_images``: whether its messages may hold
    images (checked against the model at start-up)."""

    shows_images: bool = False

    def __init__(
        self,
        tool_format: str = "hermes",
        chat_template: str | None = None,  # a template, or a file holding one
        turn_split: str = "history",
    ):
        if chat_template is not None and len(chat_template) < 256 and Path(chat_template).is_file():
            chat_template = Path(chat_template).read_text()
        self.chat = ChatOptions(tool_format, chat_template, turn_split)

    async def reset(self, sample: Prompt, task: Task) -> Opening:
        raise NotImplementedError

    async def step(self, message: Message) -> MessageStep:
        raise NotImplementedError


def is_chat_env(cls: type) -> bool:
    """Whether ``cls`` speaks messages (a :class:`ChatEnv`)."""
    return isinstance(cls, type) and issubclass(cls, ChatEnv)


class ToolEnv(ChatEnv):
    """A ChatEnv whose tools are its methods named in ``tools`` (their schemas go to the
    template). ``step`` runs an assistant's calls in order and answers each with a tool
    message; a turn without calls goes to :meth:`answer` (the final answer: score it)."""

    tools: tuple[dict, ...] = ()  # JSON schemas; each function's name is a method

    async def step(self, message: Message) -> MessageStep:
        if not message.tool_calls and not message.errors:
            return await self.answer(message)
        out = [Message("tool", f"error: {e}", name="error") for e in message.errors]
        for call in message.tool_calls:
            out.append(Message("tool", await self.call(call), tool_call_id=call.id,
                               name=call.name))  # fmt: skip
        return MessageStep(messages=out, tool_calls=len(message.tool_calls))

    async def call(self, call: ToolCall) -> str | list[Part]:
        """One call's result (text, or parts with images), or ``error: ...`` (never
        raises)."""
        names = [t["function"]["name"] for t in self.tools]
        if call.name not in names:
            return f"error: unknown tool {call.name!r} (tools: {', '.join(names)})"
        try:
            out = getattr(self, call.name)(**call.arguments)
            if inspect.isawaitable(out):
                out = await out
            return tool_content(out)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a tool's failure is the model's feedback
            return f"error: {type(e).__name__}: {e}"

    async def answer(self, message: Message) -> MessageStep:
        """A turn without tool calls (default: the episode ends, reward 0)."""
        return MessageStep(done=True)


def tool_content(out: Any) -> str | list[Part]:
    """A tool's return as a tool message's content: an :class:`ImagePart` or a list of
    parts as parts (TypeError for a part that is neither), anything else as its text."""
    if isinstance(out, ImagePart):
        return [out]
    if isinstance(out, list) and any(isinstance(p, ImagePart) for p in out):
        bad = [type(p).__name__ for p in out if not isinstance(p, Part)]
        if bad:
            raise TypeError(f"a tool's parts must be strings or ImageParts, not {bad[0]}")
        return list(out)
    return str(out)
