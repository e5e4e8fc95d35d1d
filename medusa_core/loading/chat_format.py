"""Chat history -> prompt token ids, and the tokens that end a turn.

The tokenizer's own chat template is used when it has one; vicuna v1.1-style models
(vicuna v1.3 / v1.5 ship no template) get FastChat's vicuna v1.1 prompt, ``vicuna_prompt`` below
(docs/design.md, "Architecture and data flow").
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from jinja2 import TemplateError, TemplateSyntaxError

VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)
ROLES = ("system", "user", "assistant")
ROLE_ALIASES = {"developer": "system"}   # OpenAI's newer name for the system role
# Turn-ending tokens of the common chat formats; only those the tokenizer knows are used.
TURN_END_TOKENS = ("</s>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>")


def _text(content: Any, index: int) -> str:
    """A message's content as text: a string, one part, or Gradio 6's list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, Mapping):
        content = [content]
    if isinstance(content, Iterable):
        pieces = []
        for part in content:
            if isinstance(part, str):
                pieces.append(part)
            elif isinstance(part, Mapping) and part.get("type", "text") == "text":
                if not isinstance(part.get("text"), str):   # not an attachment: a text part that lost its text
                    raise ValueError(f"message {index} has a text part whose \"text\" is "
                                     f"{json_kind(part.get('text')) if 'text' in part else 'missing'}: give "
                                     '{"type": "text", "text": "..."}')
                pieces.append(part["text"])
            else:
                kind = (f"a part of type {json_value(part.get('type'))}" if isinstance(part, Mapping)
                        else f"{json_kind(part)} as a part")
                raise ValueError(f"message {index} has {kind}: this chat takes text only; remove the attachment")
        return "".join(pieces)
    raise ValueError(f"message {index} content is {json_kind(content)}: give a string or a list of text parts")


def json_kind(value: Any) -> str:
    """What a value is, as JSON names it ("null", "a boolean", not NoneType or bool): the messages come
    from a JSON request."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an object" if isinstance(value, Mapping) else "an array" if isinstance(value, (list, tuple)) else \
        f"a {type(value).__name__}"


def json_value(value: Any) -> str:
    """A value as the client wrote it in JSON (true, null, "ten"; not Python's True, None, 'ten'), cut short with
    a mark (cut without one, a 41-character model id read as another id)."""
    text = json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= 40 else text[:39] + "…"


MESSAGE_SHAPE = '{"role": ..., "content": ...}'


def to_messages(history: Any) -> list[dict]:
    """Plain str, OpenAI-style dicts (content str or list of parts) -> [{"role", "content": str}]."""
    if isinstance(history, str):
        return [{"role": "user", "content": history}]
    messages = []
    for i, message in enumerate(history):
        if not isinstance(message, Mapping):
            raise ValueError(f"message {i} is {json_kind(message)}: give {MESSAGE_SHAPE} objects")
        missing = [key for key in ("role", "content") if key not in message]
        if missing:
            raise ValueError(f"message {i} has no {' or '.join(missing)}: give {MESSAGE_SHAPE} objects")
        role = message["role"]
        role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        if role not in ROLES:
            raise ValueError(f"message {i} has role {json_value(message['role'])}: use one of "
                             f"{', '.join([*ROLES, *ROLE_ALIASES])}")
        messages.append({"role": role, "content": _text(message["content"], i)})
    return messages


def vicuna_prompt(messages: list[dict], system: str | None = None, eos: str = "</s>") -> str:
    """FastChat's vicuna_v1.1 form: 'SYS USER: q ASSISTANT: a</s>USER: q2 ASSISTANT:'."""
    if messages and messages[0]["role"] == "system":
        system = system if system is not None else messages[0]["content"]
        messages = messages[1:]
    text = (VICUNA_SYSTEM if system is None else system) + " "
    for m in messages:
        if m["role"] == "user":
            text += f"USER: {m['content']} "
        elif m["role"] == "assistant":
            text += f"ASSISTANT: {m['content']}{eos}"
        else:
            raise ValueError("a system message after the first turn has no place in the vicuna format: put it first")
    return text + "ASSISTANT:"


# Put after the first character of a special token's text in a message: the text stays text (the model reads
# "<", an invisible character, "|im_end|>"), and nothing else in the prompt changes, whatever the tokenizer
# and the template (tokenizing the messages apart from the template put a stray "▁" before each message on
# SentencePiece tokenizers, and a template that trims messages could not be spliced at all)
_BREAK = "\u200b"


def render_chat(tokenizer, messages: Any, system: str | None = None) -> list[int]:
    """Token ids of the conversation, ending with the prompt for the assistant's reply. A special token's
    text inside a message ("<|im_end|>" in a pasted file) is text, not the token: as the token it closed the
    user's turn, and what followed could pass for a system or assistant turn. A blank system message is none (the
    model's default system prompt), as the page takes a blank system prompt: frontends send one, and its greedy
    answer differed from the page's (review)."""
    specials = sorted({token.content for token in tokenizer.added_tokens_decoder.values() if token.special},
                      key=len, reverse=True)
    messages = [{**m, "content": _as_text(m["content"], specials)} for m in to_messages(messages)
                if m["role"] != "system" or m["content"].strip()]
    system = _as_text(system, specials) if system is not None else None
    if getattr(tokenizer, "chat_template", None):
        if system is not None:
            messages = [{"role": "system", "content": system}] + [m for m in messages if m["role"] != "system"]
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except TemplateSyntaxError as err:   # no conversation is at fault: the template itself cannot be read
            raise ValueError(f"the model's chat template cannot be read ({err}): fix chat_template in its "
                             "tokenizer_config.json, or load another model") from None
        except TemplateError as err:   # the template's own raise_exception: Gemma's takes no system prompt,
            # Mistral's wants user and assistant turns to alternate (it was a traceback, and a bare 500)
            raise ValueError(f"the model's chat template refuses this conversation ({err}): change it as the "
                             "template asks (some models take no system prompt; some need user and assistant "
                             "messages to alternate)") from None
        # the template already wrote the BOS text; adding special tokens again would double it
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    text = vicuna_prompt(messages, system, tokenizer.eos_token or "</s>")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    return ([bos] if bos is not None and ids[:1] != [bos] else []) + ids


def _as_text(text: str, specials: list[str]) -> str:
    """``text`` with the text of each special token in ``specials`` (longest first) broken by _BREAK."""
    for token in specials:
        if len(token) > 1 and token in text:
            text = text.replace(token, token[0] + _BREAK + token[1:])
    return text


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """EOS plus every turn-end token this tokenizer has as a real (non-unk) token."""
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for value in eos if isinstance(eos, list) else [eos]:
        if value is not None:
            ids.append(int(value))
    vocab = tokenizer.get_vocab()
    for token in TURN_END_TOKENS:
        if token in vocab and vocab[token] != tokenizer.unk_token_id:
            ids.append(int(vocab[token]))
    return tuple(dict.fromkeys(ids))
