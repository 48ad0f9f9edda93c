"""How a tokenizer's chat template writes tools, tool calls and tool messages, as token ids.

The tool protocol (Hermes/Qwen2.5 style, as verl's and SGLang's search recipes use it): the system
turn lists the tools' JSON schemas, the model writes `<tool_call>{"name": …, "arguments": {…}}
</tool_call>`, and the answer comes back as a tool message, which Qwen2.5's template writes as a
user turn holding `<tool_response>…</tool_response>`.

`ChatFormat` reads everything from the template itself — the prompt with the tools, the text that
closes an assistant turn, the text around a tool message — by rendering small conversations and
taking their differences, so the ids the rollout appends are the ones the template would give for
the whole conversation. Templates that cannot render tools (ChatML without a tools section, e.g.
the bundled SmolLM2) get `CHATML_TOOLS_TEMPLATE`, ours, with one warning.
"""
from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

# ChatML with tools: the schemas go into the system turn, tool calls into the assistant turn and
# tool messages into a user turn as <tool_response> blocks (consecutive ones share the turn), the
# way Qwen2.5's template writes them. The instructions are ours.
CHATML_TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}"
    "{%- else %}{{- 'You are a helpful assistant.\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call the functions below. Their JSON signatures are listed between "
    "<tools> and </tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call one, write a JSON object with its name and arguments between "
    "<tool_call> and </tool_call>:\\n<tool_call>\\n{\"name\": <function name>, \"arguments\": "
    "<arguments as a JSON object>}\\n</tool_call>\\nIts result comes back between <tool_response> and "
    "</tool_response>.<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set call = call.function if call.function is defined else call %}"
    "{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}"
    "{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool_7f3a", "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}
_MARK, _CONTENT = "MARK_5e1c", "CONTENT_9b2d"


def _render(tokenizer, messages, tools, template, generation_prompt: bool, template_kwargs=None) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                         add_generation_prompt=generation_prompt, **(template_kwargs or {}))


def renders_tools(tokenizer, template: str | None = None) -> bool:
    """Whether the template lists tools in the prompt and writes tool messages."""
    try:
        prompt = _render(tokenizer, [{"role": "user", "content": "q"}], [_PROBE_TOOL], template, True)
        reply = _render(tokenizer, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                                    {"role": "tool", "content": _CONTENT}], [_PROBE_TOOL], template, True)
    except Exception:  # a template that raises on tools or the tool role
        return False
    return "probe_tool_7f3a" in prompt and _CONTENT in reply


class ChatFormat:
    """Prompt ids with tools, and the ids of a tool message, for one tokenizer and tool list.
    `template_kwargs`: more keyword arguments of the template (data.apply_chat_template_kwargs),
    used for every rendering, so a switch such as Qwen3's enable_thinking reaches the generation
    prompt written after each tool message too."""

    def __init__(self, tokenizer, tools: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tool protocol needs a chat template (the tokenizer has none): use an instruct "
                             "model, or the tag protocol (Search-R1's <search> tags) for a base model")
        self.tokenizer, self.tools = tokenizer, tools
        self.template_kwargs = dict(template_kwargs or {})
        self.template = None
        if not renders_tools(tokenizer):
            log.warning("the tokenizer's chat template cannot render tools; using the ChatML tool template "
                        "(verl.tools.chat.CHATML_TOOLS_TEMPLATE)")
            self.template = CHATML_TOOLS_TEMPLATE
        self.turn_end, self.tool_open, self.tool_close = self._tool_message_frame()

    def render(self, messages: list[dict], generation_prompt: bool = True) -> str:
        return _render(self.tokenizer, messages, self.tools, self.template, generation_prompt, self.template_kwargs)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.encode(self.render(messages))

    def _tool_message_frame(self) -> tuple[str, str, str]:
        """(text after an assistant turn's content, text before a tool message's content, text after
        it up to the next assistant turn's start), read off the template."""
        user = [{"role": "user", "content": "q"}]
        before = self.render(user + [{"role": "assistant", "content": _MARK}], generation_prompt=False)
        after = self.render(user + [{"role": "assistant", "content": _MARK},
                                    {"role": "tool", "content": _CONTENT}])
        if not after.startswith(before) or _CONTENT not in after[len(before):]:
            raise ValueError("the chat template writes a conversation differently once a tool message follows; "
                             "the tool protocol cannot append tool messages token by token with it")
        turn_end = before[before.rindex(_MARK) + len(_MARK):]
        tool_open, _, tool_close = after[len(before):].partition(_CONTENT)
        return turn_end, tool_open, tool_close

    def tool_message_ids(self, content: str, max_tokens: int) -> list[int]:
        """Closes the assistant turn, writes `content` as a tool message and opens the next assistant
        turn. The content is cut to fit `max_tokens` for the whole; the framing always stays."""
        frame = len(self.encode(self.turn_end + self.tool_open + self.tool_close))
        content_ids = self.encode(content)
        if len(content_ids) > max(0, max_tokens - frame):
            content = self.tokenizer.decode(content_ids[:max(0, max_tokens - frame)])
        # One string, one encode: the ids are the template's for this text, boundaries included.
        return self.encode(self.turn_end + self.tool_open + content + self.tool_close)
