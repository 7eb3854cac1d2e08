"""Tool-calling conversations and chat templates with tool support, for the tests of issue 52.

:data:`QWEN_STYLE_TEMPLATE` is written after the structure of Qwen3's published chat template
(no generation markers; tools listed in the system turn inside ``<tools>``; calls as
``<tool_call>`` JSON; tool results inside ``<tool_response>`` in a user turn; the reasoning of
turns before the last user question dropped, the last turns' kept in ``<think>``), so the
masking by rendering is exercised on the layout a real target uses. The tiny demo template
(:data:`~dflash_recipes.executor.demo.tiny_tokenizer.TINY_CHAT_TEMPLATE`) is the other one: it
has generation markers and its own syntax.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from transformers import PreTrainedTokenizerFast

from dflash_recipes.executor.demo.tiny_tokenizer import build_tiny_tokenizer

QWEN_STYLE_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- "# Tools\\n\\nYou may call one or more functions.\\n\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nFor each call, return a JSON object in "
    ~ "<tool_call></tool_call> tags.<|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
{%- set index = (messages|length - 1) - loop.index0 %}
{%- if message.role == 'user' and ns.last_query_index == messages|length - 1 %}
{%- set ns.last_query_index = index %}
{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- set content = message.content if message.content is string else '' %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{%- set reasoning_content = message.reasoning_content
    if message.reasoning_content is string else '' %}
{%- if loop.index0 > ns.last_query_index and reasoning_content %}
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n')
    + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
{%- else %}
{{- '<|im_start|>assistant\\n' + content }}
{%- endif %}
{%- if message.tool_calls %}
{%- for tool_call in message.tool_calls %}
{%- if (loop.first and content) or (not loop.first) %}{{- '\\n' }}{%- endif %}
{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}
{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}
{%- endif %}
{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

#: A template without tool support (plain ChatML): it renders every turn's text only.
PLAIN_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Today's weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}

#: The texts a tool row's parts hold, each unique in the rendering (tests find them by text).
ANSWER = "Paris is sunny at 18 degrees today."
REASONING = "The user wants the weather, so call the tool first."
FINAL_REASONING = "The tool said sunny and 18."
TOOL_RESULT = '{"sky": "sunny", "celsius": 18}'
QUESTION = "What is the weather in Paris?"


def tool_row(**extra: Any) -> dict[str, Any]:
    """An OpenAI-format row: tools, a user question, an assistant turn with reasoning and a
    tool call (no text), the tool's result and the assistant's final answer with reasoning."""
    return {
        "tools": [WEATHER_TOOL],
        "messages": [
            {"role": "system", "content": "You are a weather assistant."},
            {"role": "user", "content": QUESTION},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": REASONING,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": TOOL_RESULT},
            {"role": "assistant", "content": ANSWER, "reasoning_content": FINAL_REASONING},
        ],
        **extra,
    }


@cache
def tool_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny byte-level tokenizer (trained on tool-calling text too), built locally."""
    texts = [QUESTION, ANSWER, REASONING, FINAL_REASONING, TOOL_RESULT, "get_weather city"] * 4
    return build_tiny_tokenizer(texts)
