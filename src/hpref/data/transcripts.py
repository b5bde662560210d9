"""Conversations in the forms chosen/rejected data comes in, parsed into (role, text) messages and
then into user turns and assistant answers: HH-RLHF transcripts ("\\n\\nHuman: ...\\n\\nAssistant: ...")
and TRL-style message lists (`[{"role": ..., "content": ...}, ...]`).
"""

from __future__ import annotations

from typing import Any

from hpref.data.base import RowError
from hpref.data.tables import clean_text, load_json

USER_ROLES = {"user", "human", "prompter"}
ASSISTANT_ROLES = {"assistant", "gpt", "bot", "model"}
HH_MARKERS = ("\n\nHuman:", "\n\nAssistant:")


def parse_hh_transcript(text: str, column: str) -> list[tuple[str, str]]:
    """`"\\n\\nHuman: hi\\n\\nAssistant: hello"` -> [("user", "hi"), ("assistant", "hello")]."""
    if text.startswith(("Human:", "Assistant:")):
        text = "\n\n" + text
    messages: list[tuple[str, str]] = []
    first = min((i for i in (text.find(m) for m in HH_MARKERS) if i >= 0), default=-1)
    if first < 0:
        raise RowError(
            column,
            "no '\\n\\nHuman:' / '\\n\\nAssistant:' markers: expected an HH-RLHF transcript, a message "
            "list, or a prompt column beside plain-string answers",
        )
    if text[:first].strip():
        raise RowError(column, "text before the first '\\n\\nHuman:' marker")
    position = first
    while position < len(text):
        marker = next(m for m in HH_MARKERS if text.startswith(m, position))
        role = "user" if marker == HH_MARKERS[0] else "assistant"
        start = position + len(marker)
        following = [i for i in (text.find(m, start) for m in HH_MARKERS) if i >= 0]
        end = min(following, default=len(text))
        messages.append((role, text[start:end].strip()))
        position = end
    return messages


def parse_messages(value: Any, column: str) -> list[tuple[str, str]]:
    """A TRL-style message list (or its JSON text) -> [(role, content), ...] with roles normalised."""
    if isinstance(value, str):
        value = load_json(value, column, "not a message list")
    if not isinstance(value, list | tuple):
        raise RowError(column, f"expected a list of messages, got {type(value).__name__}")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise RowError(column, f"message {i} is not an object with 'role' and 'content'")
        role = str(message["role"]).lower()
        content = message["content"]
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise RowError(column, f"message {i} content is {type(content).__name__}, expected a string")
        if role in USER_ROLES:
            role = "user"
        elif role in ASSISTANT_ROLES:
            role = "assistant"
        elif role != "system":
            raise RowError(column, f"message {i} has unknown role {message['role']!r}")
        messages.append((role, clean_text(content)))
    return messages


def to_turns(messages: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """Messages -> (user turns, assistant answers), one answer per user turn.

    System text is prepended to the first user turn (the record has no system field, and dropping it
    would change the task). Consecutive messages of one role are merged (HH-RLHF has a few); an
    answer before any user message gets an empty user turn.
    """
    system = [c for r, c in messages if r == "system" and c]
    users: list[str] = []
    answers: list[str] = []
    answered = True
    for role, content in messages:
        if role == "user":
            if not answered:  # a second user message before any answer: the same turn
                users[-1] = f"{users[-1]}\n\n{content}" if users[-1] else content
                continue
            users.append(content)
            answers.append("")
            answered = False
        elif role == "assistant":
            if not users:
                users.append("")
                answers.append("")
            answers[-1] = f"{answers[-1]}\n\n{content}" if answers[-1] else content
            answered = True
    if system:
        head = "\n\n".join(system)
        if users:
            users[0] = f"{head}\n\n{users[0]}" if users[0] else head
        else:
            users, answers = [head], [""]
    return users, answers


# --------------------------------------------------------------------------------------------------
# chat-templated text, as RL frameworks send it to a reward service

#: (start of a message up to its role, end of the role, end of the message) of the chat templates a
#: policy's decoded text is found in: ChatML (Qwen, SmolLM2, ...), Llama 3, Gemma
CHAT_TEMPLATES = (
    ("<|im_start|>", "\n", "<|im_end|>"),
    ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    ("<start_of_turn>", "\n", "<end_of_turn>"),
)
#: end-of-sequence and end-of-turn tokens a decoded answer may still carry at its end
END_MARKERS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<end_of_turn>",
    "<eos>",
    "</s>",
)


def strip_end_markers(text: str) -> str:
    """`text` without the end-of-turn / end-of-sequence tokens (and whitespace) at its end."""
    text = text.rstrip()
    while True:
        marker = next((m for m in END_MARKERS if text.endswith(m)), None)
        if marker is None:
            return text
        text = text[: -len(marker)].rstrip()


def parse_chat_text(text: str) -> list[tuple[str, str]] | None:
    """A conversation rendered by a chat template (ChatML, Llama 3, Gemma) or as an HH-RLHF
    transcript -> [(role, content), ...] with roles normalised; None when `text` is in none of them.

    The last message may be unterminated (an answer cut at the length limit, or the empty assistant
    turn a generation prompt opens); text outside messages (BOS tokens, a trailing EOS) is ignored.
    """
    for start, role_end, end in CHAT_TEMPLATES:
        if start not in text:
            continue
        messages = []
        for chunk in text.split(start)[1:]:
            role, sep, body = chunk.partition(role_end)
            if not sep:
                return None
            content = strip_end_markers(body.split(end, 1)[0]).strip()
            messages.append({"role": role.strip(), "content": content})
        try:
            return parse_messages(messages, "text")
        except RowError:
            return None
    if text.startswith(("Human:", "\n\nHuman:")) or HH_MARKERS[0] in text:
        try:
            return parse_hh_transcript(text, "text")
        except RowError:
            return None
    return None


def render_chatml(messages: list[dict[str, str]], *, open_reply: bool = False) -> str:
    """Chat messages as ChatML text (what `parse_chat_text` reads back); `open_reply` ends with the
    assistant turn opened, as a generation prompt does."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if open_reply else "")
