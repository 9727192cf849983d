"""Chat messages to token ids, incrementally and exactly: how the multi-turn runner
(asyncrl/actor/env_runner.py) drives a message-level env (asyncrl/envs/messages.py).

    reset:  Opening(messages, tools) ─▶ template(messages, generation prompt) = T0
            ─▶ T0 tokenized once: the episode's prompt ids
    turn k: the engine's ids (mask 1) ─▶ decoded: ``raw`` (special tokens kept, what the
            sequence holds) and ``shown`` (without them) ─▶ tool calls parsed from
            ``shown`` by env.tool_format ─▶ env.step(assistant message) ─▶ new messages
            segment = template(context + assistant(shown) + new, generation prompt)
                      past (context's text + raw)   ─▶ tokenized once (mask 0)

``context`` is the whole history under ``turn_split=history`` (its text is exactly what
was sent so far), a fixed one-message context under ``turn_split=delta``. Either way
the sequence is the engine's ids and segments appended, never re-tokenized; under
``history`` it is also the template's full render of the conversation, which
:class:`ChatRenderer` checks once for the model (a probe episode of three turns: a tool
call, its result, an answer, a user turn, an answer): the render of each longer history
must extend what was sent before it, the model's turn being its text and the
tokenizer's EOS. A template that fails (one that numbers turns, drops earlier turns,
renders the model's turn otherwise) is refused at start-up, naming the model and the
keys that fix it. A real turn that still breaks the prefix (the model wrote special
tokens mid-turn) ends its episode as ``env_error``.

A template that does not render tool schemas (SmolLM2's ignores ``tools``) gets them
described in the system message by the tool format (``ToolFormat.describe``).

Images (a message's :class:`ImagePart`): the template renders each image part as the
model's placeholder text (``<image>``), so every text above (``sent``, each segment)
holds one placeholder per image, in order; the opening's images go with the
:class:`Rendered` prompt and a step's with its ``StepResult.images``, where the runner
expands the placeholders exactly as for a text env's observation images
(asyncrl/actor/image_tokens.py). For an env that ``shows_images`` the renderer knows
the placeholder: the probe's tool result then holds an image, and a template that does
not render an image part as the placeholder is refused with the rest; a render whose
placeholders are not its images' count ends the episode as ``env_error``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from asyncrl.envs.base import Rendered, StepResult
from asyncrl.envs.messages import (
    ChatEnv,
    ChatOptions,
    ImagePart,
    Message,
    MessageStep,
    Opening,
)
from asyncrl.models.tool_calls import ToolCall, tool_format
from asyncrl.tasks.base import Prompt, Task

PROBE_TOOLS = [{"type": "function", "function": {
    "name": "probe", "description": "a probe tool",
    "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}]  # fmt: skip
DELTA_CONTEXT = [Message("user", "Hello.")]  # turn_split=delta: what every segment follows


class TemplateDrift(ValueError):
    """A render does not extend what was already sent (the template is not append-only
    for this model, or renders the model's turn unlike its tokens)."""


class ChatRenderer:
    """One model's chat template under one env's :class:`ChatOptions` (built once per
    runner; under ``turn_split=history`` the constructor runs the append-only check)."""

    def __init__(
        self, tokenizer: Any, options: ChatOptions, model: str, placeholder: str | None = None
    ):
        self.tok, self.options, self.model = tokenizer, options, model
        self.placeholder = placeholder  # an image part's text (None: images not checked)
        self.format = tool_format(options.tool_format)
        self.eos = tokenizer.eos_token or ""
        self.renders_tools = self._renders_tools()
        if options.turn_split == "history":
            self.check()

    def render(self, messages: list[Message], tools: list[dict], generation: bool = True) -> str:
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": generation}
        if tools and self.renders_tools:
            kwargs["tools"] = tools
        elif tools and (text := self.format.describe(tools)):
            messages = with_system(messages, text)
        if self.options.chat_template is not None:
            kwargs["chat_template"] = self.options.chat_template
        return self.tok.apply_chat_template([m.as_dict() for m in messages], **kwargs)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> tuple[str, str]:
        """(raw, shown): the turn's text with and without special tokens."""
        kw = {"clean_up_tokenization_spaces": False}
        return (self.tok.decode(ids, skip_special_tokens=False, **kw),
                self.tok.decode(ids, skip_special_tokens=True, **kw))  # fmt: skip

    def segment(self, sent: str, context: list[Message], tools: list[dict], shown: str,
                raw: str, new: list[Message]) -> str:  # fmt: skip
        """The text after the model's turn: ``new`` rendered with the generation prompt,
        past ``sent`` (the context's text) and the turn's ``raw`` text."""
        full = self.render([*context, Message("assistant", shown), *new], tools)
        if not full.startswith(sent + raw):
            at = next((i for i, (a, b) in enumerate(zip(full, sent + raw)) if a != b),
                      min(len(full), len(sent + raw)))  # fmt: skip
            raise TemplateDrift(
                f"{self.model}: the chat template is not append-only for this model: "
                f"after {len(context) + 1} messages it renders {full[at : at + 40]!r} where "
                f"{(sent + raw)[at : at + 40]!r} was sent"
            )
        return full[len(sent + raw) :]

    def check(self) -> None:
        """Render a probe episode incrementally and in full (TemplateDrift if they differ;
        a template that refuses the probe's messages raises too, as a ValueError). With a
        placeholder, the tool result holds an image, which must render as it, once."""
        history = [Message("system", "Probe."), Message("user", "Call the probe.")]
        result: str | list = "2" if self.placeholder is None else ["2", ImagePart(probe_png())]
        turns = [
            (self.format.write(ToolCall("call_0", "probe", {"x": 1})),
             [Message("tool", result, tool_call_id="call_0", name="probe")]),
            ("The probe gave 2.", [Message("user", "Thanks. Once more?")]),
            ("No more.", []),
        ]  # fmt: skip
        try:
            sent = self.render(history, PROBE_TOOLS)
            for shown, new in turns:
                seg = self.segment(sent, history, PROBE_TOOLS, shown, shown + self.eos, new)
                history = [*history, Message("assistant", shown), *new]
                sent += shown + self.eos + seg
            self.check_images(sent, 1 if self.placeholder is not None else 0)
        except TemplateDrift as e:
            raise TemplateDrift(
                f"{e}; set env.chat_template to an append-only template, or "
                "env.turn_split=delta (each turn rendered after a fixed context)"
            ) from None
        except Exception as e:  # noqa: BLE001 - jinja's errors, a template's raise_exception
            raise ValueError(
                f"{self.model}: the chat template cannot render a tool episode "
                f"({type(e).__name__}: {' '.join(str(e).split())[:160]}); set env.chat_template"
            ) from None

    def check_images(self, text: str, images: int) -> None:
        """``text`` holds one placeholder per image (ValueError otherwise; nothing to
        check without a placeholder)."""
        if self.placeholder is None:
            return
        have = text.count(self.placeholder)
        if have != images:
            raise ValueError(
                f"{self.model}: the chat template renders {have} {self.placeholder} for "
                f"{images} image parts: it must render each image part "
                f"({{'type': 'image'}}) as {self.placeholder}"
            )

    def _renders_tools(self) -> bool:
        """Whether the template shows tool schemas it is given."""
        user = [Message("user", "x")]
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": True}
        if self.options.chat_template is not None:
            kwargs["chat_template"] = self.options.chat_template
        try:
            with_tools = self.tok.apply_chat_template(
                [m.as_dict() for m in user], tools=PROBE_TOOLS, **kwargs
            )
        except Exception:  # noqa: BLE001 - a template that refuses tools: described instead
            return False
        return with_tools != self.tok.apply_chat_template([m.as_dict() for m in user], **kwargs)


def with_system(messages: list[Message], text: str) -> list[Message]:
    """``messages`` with ``text`` ending the system message (one added if none)."""
    if messages and messages[0].role == "system":
        first = messages[0].content
        if isinstance(first, list):
            return [Message("system", [*first, f"\n\n{text}"]), *messages[1:]]
        return [Message("system", f"{first}\n\n{text}"), *messages[1:]]
    return [Message("system", text), *messages]


def probe_png() -> bytes:
    """A small gray PNG: the probe episode's tool image."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (128, 128, 128)).save(buf, format="PNG")
    return buf.getvalue()


class ChatTurns:
    """A :class:`ChatEnv` as the text env the multi-turn runner drives: ``reset`` answers
    the rendered prompt (:class:`Rendered`), ``step`` the rendered segment."""

    def __init__(self, env: ChatEnv, renderer: ChatRenderer):
        self.env, self.r = env, renderer
        self.history: list[Message] = []
        self.tools: list[dict] = []
        self.sent = ""  # the text of every token so far (prompt, turns, segments)

    async def reset(self, sample: Prompt, task: Task) -> Rendered:
        opening = await self.env.reset(sample, task)
        if not isinstance(opening, Opening):
            raise TypeError(f"reset() returned {type(opening).__name__}, not an Opening")
        self.history, self.tools = list(opening.messages), list(opening.tools)
        self.sent = self.r.render(self.history, self.tools)
        images = [png for m in self.history for png in m.images]
        self.r.check_images(self.sent, len(images))
        return Rendered(self.sent, self.r.encode(self.sent), images)

    async def step(self, text: str, token_ids: list[int]) -> StepResult:
        raw, shown = self.r.decode(token_ids)
        parsed = self.r.format.parse(shown)
        out = await self.env.step(
            Message("assistant", parsed.content, parsed.calls, errors=parsed.errors)
        )
        if not isinstance(out, MessageStep):
            raise TypeError(f"step() returned {type(out).__name__}, not a MessageStep")
        result = StepResult(reward=out.reward, done=out.done, tool_calls=out.tool_calls,
                            info=out.info)  # fmt: skip
        if out.done:
            return result
        if self.r.options.turn_split == "history":
            context, sent = self.history, self.sent
        else:
            context, sent = DELTA_CONTEXT, self.r.render(DELTA_CONTEXT, self.tools)
        seg = self.r.segment(sent, context, self.tools, shown, raw, out.messages)
        images = [png for m in out.messages for png in m.images]
        self.r.check_images(seg, len(images))
        self.history = [*self.history, Message("assistant", shown), *out.messages]
        self.sent += raw + seg
        result.observation, result.images = seg, images
        return result

    async def close(self) -> None:
        close = getattr(self.env, "close", None)
        if close is not None:
            out = close()
            if asyncio.iscoroutine(out):
                await out
