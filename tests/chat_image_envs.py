"""Message-level envs whose messages show images (asyncrl/envs/messages.py
``ImagePart``), for tests/test_chat_images.py and tests/test_vlm_fidelity.py: it imports
only asyncrl, so a Ray worker (whose path holds the repository root) builds them as
``tests.chat_image_envs.<name>``."""

from __future__ import annotations

from asyncrl.envs.messages import ChatEnv, ImagePart, Message, MessageStep, Opening, ToolEnv
from asyncrl.models.tool_calls import ToolCall
from asyncrl.tasks.visual import png_bytes

# the tiny VLM's chat: a message's text and image parts in order (an image part as
# `<image>`), the model's turns and EOS, a tool's result after `=`
IMAGE_TEMPLATE = (
    "{%- for m in messages -%}{%- if m['role'] == 'tool' -%}={%- endif -%}"
    "{%- if m['content'] is string -%}{{ m['content'] }}{%- else -%}"
    "{%- for p in m['content'] -%}{%- if p['type'] == 'image' -%}<image>{%- else -%}"
    "{{ p['text'] }}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- if m['role'] == 'assistant' -%}{{ eos_token }}{%- endif -%}{%- endfor -%}"
)
# the same, but a content is always printed as a whole (a template for text messages)
TEXT_TEMPLATE = (
    "{%- for m in messages -%}{%- if m['role'] == 'tool' -%}={%- endif -%}{{ m['content'] }}"
    "{%- if m['role'] == 'assistant' -%}{{ eos_token }}{%- endif -%}{%- endfor -%}"
)
DRAW_SUM = {"type": "function", "function": {
    "name": "draw_sum", "description": "draws the sum a+b",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}  # fmt: skip
SUM_IMAGE_SIZE = 32  # the tool's picture (another size than the prompt's 64 x 64)


def draw(text: str) -> bytes:
    """``text`` in black on a white square, as PNG bytes."""
    from PIL import Image as PIL
    from PIL import ImageDraw

    im = PIL.new("RGB", (SUM_IMAGE_SIZE, SUM_IMAGE_SIZE), (255, 255, 255))
    ImageDraw.Draw(im).text((4, 10), text, fill=(0, 0, 0))
    return png_bytes(im)


class SumPictureEnv(ToolEnv):
    """The prompt's image (a text prompt: its text drawn) in a user message; the model asks ``draw_sum`` for a picture of
    the sum, which its tool message shows; then it answers. The tiny VLM's alphabet spells
    no call syntax, so a turn ``a+b`` (no ``=``) is read as a call of ``draw_sum``."""

    shows_images = True
    tools = (DRAW_SUM,)

    def __init__(self, chat_template: str = IMAGE_TEMPLATE):
        super().__init__(tool_format="calc", chat_template=chat_template)
        self.sample = self.task = None

    async def reset(self, sample, task) -> Opening:
        self.sample, self.task = sample, task
        png = sample.meta["images"][0] if "images" in sample.meta else draw(sample.text)
        return Opening([Message("user", [ImagePart(png)])], list(self.tools))

    async def step(self, message: Message) -> MessageStep:
        if "+" in message.content and not message.tool_calls:
            call = ToolCall("call_0", "draw_sum", {"expression": message.content})
            message = Message("assistant", "", [call])
        return await super().step(message)

    def draw_sum(self, expression: str) -> ImagePart:
        return ImagePart(draw(str(sum(int(x) for x in expression.split("+")))))

    async def answer(self, message: Message) -> MessageStep:
        return MessageStep(reward=self.task.reward(self.sample, message.content)["reward"],
                           done=True)  # fmt: skip


class UndeclaredSumPictureEnv(SumPictureEnv):
    """The same env, not declaring its images (nothing refuses it at start-up)."""

    shows_images = False


class TextTemplateEnv(UndeclaredSumPictureEnv):
    """The undeclared env with a template that prints a content whole."""

    def __init__(self):
        super().__init__(TEXT_TEMPLATE)


class SumHintChatEnv(ChatEnv):
    """Whatever the first answer, a user message shows the sum's picture after ``=``;
    the second answer is scored: two images an episode, whatever the policy writes."""

    shows_images = True

    def __init__(self):
        super().__init__(tool_format="calc", chat_template=IMAGE_TEMPLATE)
        self.sample = self.task = None
        self.turn = 0

    async def reset(self, sample, task) -> Opening:
        self.sample, self.task = sample, task
        return Opening([Message("user", [ImagePart(sample.meta["images"][0])])])

    async def step(self, message: Message) -> MessageStep:
        self.turn += 1
        if self.turn == 1:
            return MessageStep(
                messages=[Message("user", ["=", ImagePart(draw(self.sample.answer))])]
            )
        return MessageStep(reward=self.task.reward(self.sample, message.content)["reward"],
                           done=True)  # fmt: skip
