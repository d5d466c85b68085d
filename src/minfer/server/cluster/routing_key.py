"""A request's routing key: the block hashes (:func:`~.prefix.block_hashes`) of its rendered prompt's
leading tokens, computed in the front from the model's tokenizer and chat template alone (no weights).

Chat requests are rendered as a replica renders them (:func:`~minfer.runtime.chat.plan_chat` over
:func:`~minfer.server.protocols.openai.parse_chat`'s messages); Anthropic Messages and OpenAI Responses bodies
are rendered from their system text and messages the same way; completions' prompts are tokenized. A
body the front cannot read gets no key (it goes to the least-loaded replica, which answers the 400).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from minfer.errors import MinferError
from minfer.formats.chat_template import ChatTemplate
from minfer.formats.tokenizer import Tokenizer
from minfer.models.bert import is_encoder_checkpoint
from minfer.models.model import TransformerModel
from minfer.runtime.chat import plan_chat
from minfer.server.cluster.prefix import BLOCK_TOKENS, MAX_BLOCKS, block_hashes
from minfer.server.errors import ApiError
from minfer.server.protocols.openai import parse_chat

MAX_KEYED_BODY = 256 * 1024  # larger bodies are not parsed by the front (they go to the least-loaded replica)
CHARS_PER_TOKEN_BOUND = 16  # text tokenized for the key: enough characters for MAX_BLOCKS blocks

CHAT_PATHS = frozenset({"/v1/chat/completions", "/chat/completions"})
MESSAGES_PATHS = frozenset({"/v1/messages", "/messages"})
RESPONSES_PATHS = frozenset({"/v1/responses", "/responses"})
COMPLETION_PATHS = frozenset({"/v1/completions", "/completions", "/completion"})


class PromptKeys:
    """Routing keys for one model's requests."""

    def __init__(self, tokenizer: Tokenizer | None, template: ChatTemplate | None) -> None:
        self.tokenizer = tokenizer  # None: an encoder's requests, which no prefix routes (least loaded)
        self.template = template

    @classmethod
    def from_model(cls, path: str | Path) -> PromptKeys:
        """The tokenizer and chat template of the model at ``path`` (its weights are mapped, not read); an
        encoder's keys are none (its passes keep no cache a prefix could reuse)."""
        if is_encoder_checkpoint(path):
            return cls(None, None)
        model = TransformerModel.from_path(path)
        tokenizer = model.load_tokenizer()
        return cls(tokenizer, model.load_chat_template(tokenizer))

    def key(self, path: str, body: bytes) -> list[bytes]:
        """The block hashes of the prompt of a request to ``path`` with ``body``; [] when there is none."""
        if len(body) > MAX_KEYED_BODY or not body or self.tokenizer is None:
            return []
        try:
            data = json.loads(body)
            if not isinstance(data, dict):
                return []
            if path in COMPLETION_PATHS:
                return self._completion_key(data.get("prompt"))
            messages = self._messages(path, data)
            if messages is None or self.template is None:
                return []
            req = parse_chat({"messages": messages, **({"tools": data["tools"]} if path in CHAT_PATHS
                                                       and "tools" in data else {})})
            plan = plan_chat(self.template, self.tokenizer, req.messages, req.options)
            return self._text_key(plan.prompt, add_special=False)
        except (ValueError, TypeError, KeyError, MinferError, ApiError):
            return []

    def _messages(self, path: str, data: dict[str, Any]) -> list[Any] | None:
        if path in CHAT_PATHS:
            return data.get("messages")
        system: Any = None
        if path in MESSAGES_PATHS:
            system, rest = data.get("system"), data.get("messages")
        elif path in RESPONSES_PATHS:
            system, rest = data.get("instructions"), data.get("input")
            if isinstance(rest, str):
                rest = [{"role": "user", "content": rest}]
        else:
            return None
        if not isinstance(rest, list):
            return None
        if isinstance(system, list):  # Anthropic's system blocks
            system = "".join(b.get("text", "") for b in system if isinstance(b, dict))
        head = [{"role": "system", "content": system}] if isinstance(system, str) and system else []
        # only the leading text decides the route: keep each message's role and plain-text content
        return head + [{"role": m.get("role"), "content": _plain(m.get("content"))} for m in rest
                       if isinstance(m, dict) and m.get("role") in ("user", "assistant", "system")]

    def _completion_key(self, prompt: Any) -> list[bytes]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # several prompts: the first decides
        if isinstance(prompt, str):
            return self._text_key(prompt, add_special=True)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return block_hashes(prompt)
        return []

    def _text_key(self, text: str, add_special: bool) -> list[bytes]:
        limit = BLOCK_TOKENS * MAX_BLOCKS * CHARS_PER_TOKEN_BOUND
        cut = len(text) > limit
        hashes = block_hashes(self.tokenizer.encode(text[:limit], add_special=add_special))
        return hashes[:-1] if cut and hashes else hashes  # the cut may have changed the last block's tokens


def _plain(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""
