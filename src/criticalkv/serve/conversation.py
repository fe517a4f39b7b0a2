"""A conversation about a stored context: the tokens that follow the stored document.

A stored context holds the prompt's head up to the end of the document (the chat template's user
turn opened, the document in it). A conversation about it (``messages`` with ``context_id``) is the
rest of that prompt: the first user message (after the document), then each later turn, rendered
by the same chat template, ending with the assistant's header; these tokens are appended to the
context's fork. Without a chat template the turns follow the document as plain text, as
:meth:`~criticalkv.serve.engine.Engine.prompt_ids` renders a conversation.
"""

from __future__ import annotations

from typing import Any

from criticalkv.prompts import unused_marker
from criticalkv.serve.errors import invalid

_SPLIT = "\u2063CRITICALKV_CONVERSATION\u2063"
#: stands for the stored document (the head of the prompt does not depend on it)
_DOCUMENT = "."


def check_turns(messages: list[tuple[str, str]]) -> None:
    """A 400 unless ``messages`` (role, text) are user and assistant turns starting and ending with a user's."""
    roles = [role for role, _ in messages]
    if any(role not in ("user", "assistant") for role in roles):
        raise invalid(
            "with context_id, send only user and assistant messages: the stored document opens the conversation",
            "messages",
        )
    if roles[0] != "user" or roles[-1] != "user":
        raise invalid("with context_id, the conversation starts and ends with a user message", "messages")
    if any(not text.strip() for role, text in messages if role == "user"):
        raise invalid("with context_id, every user message needs text", "messages")


def conversation_ids(tokenizer: Any, messages: list[tuple[str, str]]) -> list[int]:
    """Token ids of ``messages`` after a stored document (see the module), checked by :func:`check_turns`."""
    check_turns(messages)
    first, rest = messages[0][1].strip(), [{"role": r, "content": t} for r, t in messages[1:]]
    if isinstance(getattr(tokenizer, "chat_template", None), str):
        split = unused_marker(_SPLIT, *(text for _, text in messages))  # a turn quoting it never collides
        chat = [{"role": "user", "content": _DOCUMENT + split + "\n\n" + first}, *rest]
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        if not isinstance(text, str) or text.count(split) != 1:
            raise invalid("the model's chat template does not render the conversation verbatim", "messages")
        tail = text.split(split)[1]
    else:
        tail = "\n\n" + "\n\n".join([first, *(m["content"] for m in rest)]) + "\nAnswer:"
    return list(tokenizer(tail, add_special_tokens=False)["input_ids"])
