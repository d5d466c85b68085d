"""Chat turns beyond plain text: tool definitions and calls, their formats, and reasoning.

``tools`` (definitions, tool_choice, calls), ``formats`` (how models write calls, the grammar that
forces one), ``json_scan`` (JSON read while it arrives), ``output`` (a reply split into content,
reasoning and calls, streamed or whole), ``prompt`` (``plan_chat``: a request made ready to generate).
"""

from minfer.runtime.chat.output import (
    ChatDelta,
    ChatMessage,
    ChatOutputParser,
    ContentDelta,
    MessageBuilder,
    ReasoningDelta,
    ToolCallDelta,
    ToolCallStart,
)
from minfer.runtime.chat.prompt import REASONING_FORMATS, ChatOptions, ChatPlan, check_messages, plan_chat
from minfer.runtime.chat.tools import (
    ToolCall,
    ToolChoice,
    ToolSpec,
    check_json_schema,
    parse_tool_choice,
    parse_tools,
)

__all__ = [
    "ChatDelta", "ChatMessage", "ChatOutputParser", "ContentDelta", "MessageBuilder", "ReasoningDelta",
    "ToolCallDelta", "ToolCallStart", "REASONING_FORMATS", "ChatOptions", "ChatPlan", "check_messages", "plan_chat",
    "ToolCall", "ToolChoice", "ToolSpec", "check_json_schema", "parse_tool_choice", "parse_tools",
]
