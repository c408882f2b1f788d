"""The chat template: a conversation as a C++ file, for a base C++ code model that has never
seen chat turns. Instructions are comments and answers are code::

    // system: <first line of the system message>
    // <each further line>
    // user: <first line of the user message>
    // <each further line>
    <an assistant message, verbatim, followed by a newline>

System, developer and user messages render as ``//`` comment lines introduced by their
role; assistant messages are code. The completion is the code that follows the last
message, and :data:`CHAT_STOP` (``"\\n// user:"``) is always a stop sequence, so the model
cannot write the next user turn. If the last message is the assistant's, the completion
continues it (no newline is added).
"""

from __future__ import annotations

from collections.abc import Sequence

from megacpp.infer.protocol import BadRequest, ChatMessage

CHAT_STOP = "\n// user:"


def message_text(message: ChatMessage, index: int) -> str:
    """A message's text: its string content, or its text parts joined (other parts: 400)."""
    content = message.content
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise BadRequest(f"messages[{index}].content: only text parts are supported",
                             f"messages[{index}].content")
        parts.append(part["text"])
    return "".join(parts)


def render_chat(messages: Sequence[ChatMessage]) -> str:
    """The prompt text of a conversation (see the module docstring)."""
    out = []
    for i, message in enumerate(messages):
        text = message_text(message, i)
        last = i == len(messages) - 1
        if message.role == "assistant":
            out.append(text if last else text + "\n")
            continue
        lines = text.split("\n")
        out.append(f"// {message.role}: {lines[0]}".rstrip() + "\n")
        out.extend(f"// {line}".rstrip() + "\n" for line in lines[1:])
    return "".join(out)
