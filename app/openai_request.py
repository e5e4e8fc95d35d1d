"""Reading an OpenAI chat-completions request: the body (capped, UTF-8 JSON, every number finite), its fields
checked against what this server reads, and the conversation fitted to the model's context. What comes out is
a ``ChatRequest`` (the messages and the engine's ``Settings``) and the prompt's token ids; what is wrong comes
out as an ``ApiError``, OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``, with one line that
names the value and the fix. openai_api.py answers the request.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace

from fastapi import Request
from fastapi.responses import JSONResponse

from medusa_core.decoding.config import DEFAULTS, MODES, SettingError, is_greedy, limits
from medusa_core.errors import first_line
from medusa_core.loading.chat_format import MESSAGE_SHAPE, json_kind, json_value, to_messages

from .engine import BASELINE, MEDUSA, ChatEngine, EngineClosed
from .settings import Settings

MAX_BODY_BYTES = 1_000_000     # a bigger request cannot fit any context this app serves: refused unread
MAX_MESSAGES = 1000
MAX_STOPS = 4                  # as OpenAI
UNSUPPORTED = {                # fields with no meaning here: refused when they ask for something
    "tools": "tools (function calling)", "functions": "functions (function calling)",
    "tool_choice": "tool_choice", "function_call": "function_call", "logprobs": "logprobs",
    "top_logprobs": "top_logprobs", "response_format": "response_format", "audio": "audio output",
    "logit_bias": "logit_bias", "web_search_options": "web search",
}
# What a request may hold: OpenAI's chat-completions fields this server reads, the ones above (refused
# when they ask for something), ones with no effect on a local answer, and this server's "medusa".
# Anything else is refused by name, as OpenAI refuses an unrecognized argument: a misspelt field
# must not pass unnoticed.
READ = ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "stream",
        "stream_options", "n", "presence_penalty", "frequency_penalty", "medusa",
        "top_k")        # not OpenAI's, but local servers take it and so does the sampler here
NO_EFFECT = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "reasoning_effort", "modalities",
             "verbosity", "prompt_cache_key", "safety_identifier", "prediction")
STREAM_OPTIONS = ("include_usage", "include_obfuscation")   # the second changes nothing in a local answer
MEDUSA_KEYS = ("tree", "mode", "epsilon", "delta")   # what "medusa" may hold: a misspelt key is refused too
# A message's fields besides role and content that OpenAI's own responses carry, null or empty without tools: a
# client that sends a reply back as it came (the openai client's message.model_dump()) sends them
REPLY_FIELDS = ("refusal", "annotations", "audio", "function_call", "tool_calls")
TEXT_PART = '{"type": "text", "text": "..."}'


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        """OpenAI's error object: the same four keys in a response and in a stream's error event."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        # Retry-After: the openai client waits that long between its retries (it gave up 1.5 s into a load)
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]
    settings: Settings
    passes: tuple[str, ...]          # (MEDUSA,) or (BASELINE,) for plain decoding
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    length_given: bool = True        # max_tokens named; else the server's default, cut to what fits (prompt_for)


@dataclass(frozen=True)
class Unreadable:
    """A number no float holds (1e400: read as inf, it was named "Infinity", a value the client never sent) or a
    constant JSON does not allow (NaN, Infinity), kept as written while the body is parsed, so that the error
    can name the field holding it."""

    text: str

    def problem(self) -> str:
        if self.text in ("NaN", "Infinity", "-Infinity"):
            return f"{self.text}, which JSON does not allow: give a finite number"
        return f"{self.text[:40]} is beyond a float's range: give a number the field's range allows"


def first_unreadable(data) -> tuple[str, Unreadable] | None:
    """(where, value) of the first Unreadable in ``data``, where as the API names a field ("medusa.epsilon",
    "messages[0].content"); walked without recursion, since the body may nest as deep as the parser allows."""
    stack = [("", data)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, Unreadable):
            return where, value
        if isinstance(value, dict):
            inner = [(f"{where}.{key}" if where else key, item) for key, item in value.items()]
        else:
            inner = [(f"{where}[{i}]", item) for i, item in enumerate(value)] if isinstance(value, list) else []
        stack.extend(reversed(inner))      # the first field is looked at first
    return None


def too_large(size: int, more: bool = False) -> ApiError:
    return ApiError(413, f"the request is {'more than ' if more else ''}{size:,} bytes; at most {MAX_BODY_BYTES:,} are "
                         "read: shorten the messages (no model here has a context that large)", code="request_too_large")


async def capped_body(request: Request) -> bytes:
    """The body, refused past MAX_BODY_BYTES as it arrives: by its declared length unread, and a chunked one at
    the first chunk over (a 300 MB body was read whole first, and a few GB would take the process down)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large(int(declared))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_large(MAX_BODY_BYTES, more=True)
        chunks.append(chunk)
    return b"".join(chunks)


def read_body(body: bytes) -> dict:
    if len(body) > MAX_BODY_BYTES:
        raise too_large(len(body))
    unreadable: list[Unreadable] = []

    def kept(text: str) -> float | Unreadable:
        value = float(text)
        if math.isfinite(value):
            return value
        unreadable.append(Unreadable(text))
        return unreadable[-1]

    try:
        data = json.loads(body.decode("utf-8"), parse_constant=kept, parse_float=kept)
    except UnicodeDecodeError as err:
        raise ApiError(400, f"the body is not UTF-8 (byte {err.start}): send JSON text in UTF-8",
                       code="invalid_json") from None
    except RecursionError:      # 100,000 nested arrays: Python's parser gives up (a bare 500 before)
        raise ApiError(400, "the body nests JSON arrays or objects too deeply to read: send the request's fields "
                            "as the API documents them", code="invalid_json") from None
    except ValueError as err:   # JSONDecodeError, NaN/Infinity
        raise ApiError(400, f"the body is not valid JSON ({first_line(err, 120)}): send one JSON object",
                       code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the body is a JSON {type(data).__name__}: send one JSON object", code="invalid_json")
    # a number the body holds; one a repeated key replaced is gone, as JSON's last value wins (review: a bare 500)
    found = first_unreadable(data) if unreadable else None
    if found is not None:
        where, value = found
        raise ApiError(400, f"{where} {value.problem()}", param=where, code="invalid_value")
    try:    # "\ud83d" alone (a string cut mid-emoji) is valid JSON but no text: the tokenizer raised (a bare 500)
        json.dumps(data, ensure_ascii=False, default=str).encode("utf-8")
    except UnicodeEncodeError as err:
        raise ApiError(400, f"the body holds a lone UTF-16 surrogate ({ascii(err.object[err.start])}), which is no "
                            "character: send whole characters (a string cut inside an emoji?)",
                       code="invalid_json") from None
    return data


def number(data: dict, name: str, default, low: float, high: float, integer: bool = False, within: str = "",
           fix: str = ""):
    """``data[name]`` checked to be a finite number (an integer if asked) in [low, high]; ``within``: the object
    holding it, as errors name it ("medusa.epsilon"); ``fix``: what to give instead, where [low, high] is not
    the whole story (an open end)."""
    value = data.get(name)
    if value is None:
        return default
    name = f"{within}.{name}" if within else name
    kind = "an integer" if integer else "a number"
    span = f"{int(low):,} to {int(high):,}" if integer else f"{low:g} to {high:g}"
    fix = fix or f"give {kind} from {span}"
    shown = json_value(value)
    # an integer past a float's range (10**400) is compared as it is: float() of it raised (a bare 500)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (integer and isinstance(value, float) and not value.is_integer()):
        raise ApiError(400, f"{name} {shown} is not {kind}: {fix}", param=name, code="invalid_value")
    if (isinstance(value, float) and not math.isfinite(value)) or not low <= value <= high:
        raise ApiError(400, f"{name} {shown} is out of range: {fix}", param=name, code="invalid_value")
    return int(value) if integer else float(value)


def unused(data: dict, medusa: dict, mode: str, passes: tuple[str, ...], temperature: float) -> None:
    """A setting given that the decoding the request asks for never reads is refused by name, as the page greys
    it out: a client tuning it would see no change and not know why. Greedy decoding's top_p and top_k are
    taken, as OpenAI takes them: clients send them by default beside temperature 0."""
    what = "plain decoding (mode \"off\")" if passes == (BASELINE,) else f'mode "{mode}"'
    if passes == (BASELINE,) and medusa.get("tree") is not None:
        raise ApiError(400, f"medusa.tree {json_value(medusa['tree'])} with {what}: plain decoding runs no tree: "
                            "remove the tree, or the mode", param="medusa.tree", code="invalid_value")
    for key in ("epsilon", "delta"):
        if medusa.get(key) is not None and mode != "typical":
            raise ApiError(400, f"medusa.{key} sets typical acceptance, which {what} does not run: remove it, or give "
                                '"mode": "typical"', param=f"medusa.{key}", code="invalid_value")
    if mode == "typical" and is_greedy(mode, temperature):
        # QA: accepted, and greedy ran with them unread (typical acceptance at temperature 0 keeps the argmax tokens)
        for key in ("epsilon", "delta"):
            if medusa.get(key) is not None:
                raise ApiError(400, f"medusa.{key} {json_value(medusa[key])} does nothing at temperature {temperature:g}, "
                                    "where typical acceptance keeps exactly the argmax tokens (greedy): give a "
                                    "temperature above 0, or remove it", param=f"medusa.{key}", code="invalid_value")
    if mode == "typical" and not is_greedy(mode, temperature) and data.get("seed") not in (None, -1):
        # QA: taken and unused (the response's seed is null): typical acceptance draws no random number. -1 ("draw
        # one") is what llama.cpp's clients send by default, and greedy requests' seeds are taken (review)
        raise ApiError(400, f"seed {json_value(data['seed'])} does nothing under medusa.mode \"typical\", which draws no "
                            "random number: remove it, or use mode \"sample\"", param="seed", code="invalid_value")
    for field, off in (("top_p", 1), ("top_k", 0)):
        if mode == "typical" and data.get(field) not in (None, off):
            raise ApiError(400, f"{field} {json_value(data[field])} does nothing under medusa.mode \"typical\", which keeps "
                                "tokens by epsilon and delta: remove it, or use mode \"sample\"", param=field,
                           code="invalid_value")


def check_message_fields(messages: list) -> None:
    """A field a message or a text part does not take is refused by name, as the request's own fields are (a
    misspelt or unsupported one was read past: "name" changes OpenAI's answer and changed nothing here). The
    roles, contents and attachments are to_messages' to check."""
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        for key, value in message.items():
            if key in ("role", "content") or (key in REPLY_FIELDS and value in (None, [])):
                continue
            what = ("this chat has no participant names" if key == "name" else
                    "this local chat has no tools" if key in ("tool_calls", "function_call") else
                    "a message here takes role and content")
            raise ApiError(400, f"message {i} has the field {key!r} ({json_value(value)}): {what}: remove it",
                           param="messages", code="unknown_parameter")
        content = message.get("content")
        for part in [content] if isinstance(content, dict) else content if isinstance(content, list) else []:
            if not isinstance(part, dict):
                continue
            if "type" not in part:
                raise ApiError(400, f"message {i} has a part without \"type\" ({json_value(part)}): give "
                                    f"{TEXT_PART}", param="messages", code="invalid_value")
            extra = [key for key in part if key not in ("type", "text")] if part["type"] == "text" else []
            if extra:
                raise ApiError(400, f"message {i} has a text part with the field {extra[0]!r}: remove it (a text part "
                                    f"is {TEXT_PART})", param="messages", code="unknown_parameter")


def parse_chat(data: dict, engine: ChatEngine, model_id: str) -> ChatRequest:
    """The OpenAI request ``data`` as the engine's Settings; ApiError names what is wrong."""
    model = data.get("model")
    if model is None or model == "":
        raise ApiError(400, "model is missing: give the id that GET /v1/models lists", param="model",
                       code="missing_required_parameter")
    if not isinstance(model, str):
        raise ApiError(400, f"model {json_value(model)} is not a string: give the id that GET /v1/models lists",
                       param="model", code="invalid_type")
    if model != model_id:
        served = json.dumps(model_id, ensure_ascii=False)      # whole: a cut id reads as another
        raise ApiError(404, f"model {json_value(model)} is not served here: use {served} (GET /v1/models)",
                       param="model", code="model_not_found")
    unknown = [field for field in data if field not in (*READ, *UNSUPPORTED, *NO_EFFECT)]
    if unknown:
        raise ApiError(400, f"unknown field {unknown[0]!r}: remove it (this server reads OpenAI's chat-completions "
                            "fields, top_k and \"medusa\")", param=unknown[0], code="unknown_parameter")
    for field, what in UNSUPPORTED.items():
        if data.get(field) not in (None, False, [], {}, {"type": "text"}, "none"):
            raise ApiError(400, f"{what} is not supported by this local chat: remove {field!r}", param=field,
                           code="unsupported_parameter")
    modalities = data.get("modalities")
    if modalities not in (None, ["text"]):      # OpenAI's default; ["audio"] asks for what "audio" does
        raise ApiError(400, f"modalities {json_value(modalities)}: this server answers in text only: remove it, or "
                            'give ["text"]', param="modalities", code="unsupported_parameter")
    for field in ("presence_penalty", "frequency_penalty"):
        if number(data, field, 0.0, -2, 2):
            raise ApiError(400, f"{field} is not supported (the output would not be the model's own): remove it or "
                                "give 0", param=field, code="unsupported_parameter")
    n = data.get("n")
    if n is not None and (isinstance(n, bool) or not isinstance(n, (int, float))):
        raise ApiError(400, f"n {json_value(n)} is not a number: give n=1 (or leave it out)", param="n",
                       code="invalid_value")
    if n is not None and n != 1:   # one message for every other n, in range or not
        raise ApiError(400, f"n {json_value(n)}: this server answers with one choice: give n=1 and send more "
                            "requests", param="n", code="unsupported_parameter")
    messages = data.get("messages")
    if messages is not None and not isinstance(messages, list):
        raise ApiError(400, f"messages is {json_kind(messages)} {json_value(messages)}: give a list of "
                            f"{MESSAGE_SHAPE} objects", param="messages")
    if not messages:
        raise ApiError(400, "messages is missing or empty: give a list with at least one user message",
                       param="messages")
    if len(messages) > MAX_MESSAGES:
        raise ApiError(400, f"messages has {len(messages):,} entries; at most {MAX_MESSAGES:,} are accepted: "
                            "send the recent part of the conversation", param="messages")
    check_message_fields(messages)
    try:
        texts = to_messages(messages)
    except ValueError as err:   # a role or part the chat cannot take
        raise ApiError(400, str(err), param="messages") from None
    asked = [i for i, m in enumerate(texts) if m["role"] == "user"]
    if not asked:
        raise ApiError(400, "messages holds no user message: add one with the question", param="messages")
    if not texts[asked[-1]]["content"].strip():
        raise ApiError(400, f"message {asked[-1]}, the last user message, is empty: give the question's text",
                       param="messages")

    limit = engine.context          # as the page: the prompt check below refuses a reply that leaves it no room
    max_tokens = number(data, "max_completion_tokens", None, 1, limit, integer=True)
    older = number(data, "max_tokens", None, 1, limit, integer=True)      # OpenAI's older name for the same limit
    if None not in (max_tokens, older) and older != max_tokens:
        raise ApiError(400, f"max_tokens {older} and max_completion_tokens {max_tokens} disagree: give one of them",
                       param="max_tokens", code="invalid_value")
    max_tokens = max_tokens or older
    temperature = number(data, "temperature", 1.0, 0, 2)
    top_p = number(data, "top_p", 1.0, 0, 1)
    if top_p == 0:
        raise ApiError(400, "top_p 0 keeps no token: give a value in (0, 1], or temperature 0 for greedy",
                       param="top_p", code="invalid_value")
    seed = number(data, "seed", None, -(2**63), 2**63 - 1, integer=True)
    if seed == -1:      # the page's "random", and llama.cpp's server's: one is drawn and reported (it was a fixed seed)
        seed = None
    top_k = number(data, "top_k", 0, 0, 2**31 - 1, integer=True)          # 0: off
    stop = data.get("stop")
    stop = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stop, list) or len(stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, f"stop {json_value(data.get('stop'))}: give a string or a list of at most {MAX_STOPS} "
                            "non-empty strings", param="stop", code="invalid_value")
    stream = data.get("stream")
    stream = False if stream is None else stream        # null means the default, as in every other field
    options = data.get("stream_options")
    options = {} if options is None else options       # false, "" or [] are no object: refused below
    if not isinstance(stream, bool):
        raise ApiError(400, f"stream {json_value(stream)}: give true or false", param="stream", code="invalid_value")
    if not isinstance(options, dict):
        raise ApiError(400, f"stream_options {json_value(options)}: give an object, e.g. {{\"include_usage\": true}}",
                       param="stream_options", code="invalid_value")
    if options and not stream:
        raise ApiError(400, "stream_options is only taken with stream: true: drop it, or stream",
                       param="stream_options", code="invalid_value")
    for key, value in options.items():   # checked as the top level's fields are ("yes" was taken as true)
        if key not in STREAM_OPTIONS:
            raise ApiError(400, f"unknown field 'stream_options.{key}': remove it (stream_options takes "
                                f"{', '.join(STREAM_OPTIONS)})", param=f"stream_options.{key}", code="unknown_parameter")
        if value is not None and not isinstance(value, bool):
            raise ApiError(400, f"stream_options.{key} {json_value(value)}: give true or false",
                           param=f"stream_options.{key}", code="invalid_value")

    passes, mode, tree = (MEDUSA,), "greedy" if is_greedy("sample", temperature) else "sample", None
    epsilon, delta = DEFAULTS.epsilon, DEFAULTS.delta
    medusa = data.get("medusa")
    if medusa is None:          # null means the default, as in every other field
        medusa = {}
    if medusa is False or medusa == "off":
        passes = (BASELINE,)
    elif isinstance(medusa, dict):
        unknown = [key for key in medusa if key not in MEDUSA_KEYS]
        if unknown:
            raise ApiError(400, f"unknown field 'medusa.{unknown[0]}': remove it (\"medusa\" takes "
                                f"{', '.join(MEDUSA_KEYS)})", param=f"medusa.{unknown[0]}", code="unknown_parameter")
        tree = medusa.get("tree")
        if tree is not None and not isinstance(tree, str):
            raise ApiError(400, f"medusa.tree {json_value(tree)}: give a tree's name from the page's picker",
                           param="medusa.tree", code="invalid_value")
        if medusa.get("mode") is not None:
            mode = medusa["mode"]
            # both given, and they disagree (a temperature under 1e-5 is greedy too)
            if mode == "greedy" and data.get("temperature") is not None and not is_greedy("sample", temperature):
                raise ApiError(400, f"medusa.mode \"greedy\" with temperature {temperature:g}: greedy decoding draws "
                                    "nothing, so the temperature would do nothing: drop temperature (or give 0), or "
                                    "use mode \"sample\" or \"typical\"", param="temperature", code="invalid_value")
        if mode == "off":
            passes, mode = (BASELINE,), "greedy" if is_greedy("sample", temperature) else "sample"
        elif mode not in MODES:
            raise ApiError(400, f"medusa.mode {json_value(mode)} is unknown: use one of {', '.join(MODES)} (or "
                                '"medusa": false for plain decoding)',
                           param="medusa.mode", code="invalid_value")
        # a number here, named with DecodeConfig's range (0 excluded), which refuses 0 itself, as for the page
        epsilon = number(medusa, "epsilon", epsilon, 0, 1, within="medusa", fix=limits("epsilon").fix)
        delta = number(medusa, "delta", delta, 0, 1, within="medusa", fix=limits("delta").fix)
        unused(data, medusa, mode, passes, temperature)
    else:
        raise ApiError(400, f"medusa {json_value(medusa)}: give an object such as "
                            "{\"tree\": ..., \"mode\": \"typical\"}, or false for plain decoding", param="medusa",
                       code="invalid_value")
    try:
        settings = Settings(mode=mode, temperature=temperature, top_p=top_p, top_k=top_k, epsilon=epsilon, delta=delta,
                            max_new_tokens=max_tokens or engine.max_new_tokens, tree=tree, seed=seed).with_drawn_seed()
        engine.check(settings)
    except SettingError as err:     # named as the request names it: "medusa.epsilon", not "epsilon"
        name = f"medusa.{err.name}" if err.name in MEDUSA_KEYS else err.name
        raise ApiError(400, f"{name} {err.problem}", param=name, code="invalid_value") from None
    except ValueError as err:   # an unknown tree, one line from the engine
        raise ApiError(400, str(err), param="medusa.tree", code="invalid_value") from None
    except EngineClosed as closed:   # another model loaded (or none) while the request was read
        raise ApiError(503, str(closed), kind="server_error", code="model_changed") from None
    return ChatRequest(texts, settings, passes, tuple(stop), stream, bool(options.get("include_usage")),
                       max_tokens is not None)


def prompt_for(engine: ChatEngine, request: ChatRequest) -> tuple[list[int], ChatRequest]:
    """The prompt's token ids, and the request with its reply's length: the server's default (--max-new-tokens)
    cut to what the context leaves, where the request named none (with a default as long as the context,
    every such request was refused, told to fix a max_tokens it never gave). A conversation that does not fit
    the context with the reply it names is refused (a client owns its conversation, so nothing is dropped
    from it silently)."""
    chars = sum(len(m.get("content") or "") if isinstance(m, dict) and isinstance(m.get("content"), str) else 0
                for m in request.messages)
    if chars > 32 * engine.context:      # no tokenizer packs 32 characters a token: refused untokenized
        raise ApiError(400, f"the messages hold {chars:,} characters, far more than the model's {engine.context:,}-token "
                            "context: shorten them", param="messages", code="context_length_exceeded")
    try:
        ids = engine.prompt_ids(request.messages, None)
    except ValueError as err:   # a role or part the chat cannot take
        raise ApiError(400, str(err), param="messages") from None
    # plain decoding verifies one node a step, whatever the Medusa tree is
    trees = engine.trees
    tree_size = 1 if request.passes == (BASELINE,) else trees.buffers(request.settings.tree or trees.default).size
    room = engine.context - len(ids) - tree_size
    if room < 1:        # no max_tokens can help
        raise ApiError(400, f"the messages take {len(ids):,} tokens, more than the model's {engine.context:,}-token "
                            "context leaves for a reply: shorten them", param="messages", code="context_length_exceeded")
    if room < request.settings.max_new_tokens and not request.length_given:
        return ids, replace(request, settings=replace(request.settings, max_new_tokens=room))
    if room < request.settings.max_new_tokens:
        # the last step's tree is named: without it the sum fell short of the context it was said to exceed
        reply = request.settings.max_new_tokens
        raise ApiError(400, f"the messages take {len(ids):,} tokens, the reply {reply:,} and the last step's tree "
                            f"{tree_size:,} ({len(ids) + reply + tree_size:,} in all), more than the model's "
                            f"{engine.context:,}-token context: give max_tokens {room:,} or less, or shorten the "
                            "messages", param="messages", code="context_length_exceeded")
    return ids, request
