"""Pydantic bodies of the OpenAI Chat Completions and (legacy) Completions APIs.

Like vLLM, unknown fields are ignored so clients that send newer OpenAI options keep working;
options that would silently change the meaning of the answer if ignored (JSON mode,
best_of other than n, suffix, vLLM's guided decoding, beam search, prompt logprobs,
spaces_between_special_tokens false, a custom chat template; OpenAI's legacy functions, audio
output, web search) are rejected with a 400 naming them.
logit_bias is OpenAI's (keys are token-id strings). vLLM's extensions that tierlm can honour
(stop_token_ids, truncate_prompt_tokens, include_stop_str_in_output, allowed_token_ids, bad_words,
skip_special_tokens, and on chat continue_final_message / add_generation_prompt / chat_template_kwargs / documents) are honoured as vLLM does.
"""
from __future__ import annotations

import inspect
import json
from typing import Annotated, Any, Callable, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from tierlm.sampling_params import (MAX_ALLOWED_TOKEN_IDS, MAX_LOGIT_BIAS, MAX_LOGPROBS, StructuredOutputsParams,
                                    allowed_token_ids_problem, bad_words_problem, stop_strings_problem,
                                    truncate_prompt_tokens_problem, unsupported_vllm_field)
from tierlm.serving.errors import InvalidRequest


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImageUrl(_Body):
    url: str
    detail: str | None = None


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageUrl


class RefusalPart(_Body):
    """An assistant's refusal sent back (the SDK's ChatCompletionContentPartRefusalParam): its
    text is what the assistant said, rendered as its content."""

    type: Literal["refusal"]
    refusal: str


class FileRef(_Body):
    file_id: str | None = None  # a file uploaded through /v1/files
    file_data: str | None = None  # the file inline: base64, or a data: URL
    filename: str | None = None


class FilePart(_Body):
    """A file part: read as text where it is a text file (openai.read_file_parts sets its text
    before the prompt is rendered); any other file is refused, naming the part."""

    type: Literal["file"]
    file: FileRef
    _text: str | None = PrivateAttr(default=None)


ContentPart = Annotated[Union[TextPart, ImagePart, RefusalPart, FilePart], Field(discriminator="type")]


# OpenAI's rule for function names. Chat templates write names into the prompt unescaped, so a
# quote or a space would break the JSON the model is shown.
_FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


def _template_arguments() -> frozenset[str]:
    """apply_chat_template's own arguments (what the request's fields set, or what would break
    rendering), read from the installed transformers: a fixed list missed ones added since."""
    names = {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
             "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
             "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
    try:
        from transformers import PreTrainedTokenizerBase

        params = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters.values()
        names |= {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"}
    except (ImportError, AttributeError, TypeError, ValueError):
        pass
    return frozenset(names)


TEMPLATE_ARGUMENTS = _template_arguments()
# What `chat_template_kwargs` may not set (vLLM refuses the first two; the rest are the request's)
_REFUSED_TEMPLATE_KWARGS = frozenset({"chat_template", "tokenize", "conversation", "messages", "tools"})


# How much a reasoning model thinks, as OpenAI's `reasoning_effort` (chat) and `reasoning.effort`
# (Responses) say it and gpt-oss's chat template reads it (vLLM's values: gpt-oss knows these three)
ReasoningEffort = Literal["low", "medium", "high"]
EFFORT_VARIABLE = "reasoning_effort"  # the template variable both reach, as vLLM passes them


def template_variables(kwargs: dict[str, Any]) -> dict[str, Any]:
    """chat_template_kwargs less apply_chat_template's own arguments (the request's to set, or
    about tokenized output, which does not change the text), but `documents` (both APIs)."""
    return {k: v for k, v in kwargs.items() if k == "documents" or k not in TEMPLATE_ARGUMENTS}


def refused_unless_null(message: str) -> Callable[[Any], Any]:
    """A field validator (both APIs) for what tierlm cannot honour and must not ignore: any value
    but null is refused in `message`'s words."""
    def check(value: Any) -> Any:
        if value is not None:
            raise ValueError(message)
        return value
    return check


def template_kwargs_refused(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """chat_template_kwargs, refused where they set what only the request may (both APIs)."""
    taken = sorted(set(value or ()) & _REFUSED_TEMPLATE_KWARGS)
    if taken:
        raise ValueError(f"{', '.join(taken)} cannot be set here; "
                         + ("use the request's 'tools'" if taken == ["tools"] else "remove it"))
    return value


class FunctionCall(_Body):
    name: str = Field(pattern=_FUNCTION_NAME)
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = Field(default=None, validate_default=True)
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None  # an assistant's refusal sent back: rendered as its text (others have none)
    # An assistant's reasoning sent back (vLLM's fields, as tierlm returns them): Qwen3's template
    # writes it into the turns after the last user message, as in a tool loop.
    reasoning_content: str | None = None
    reasoning: str | None = None
    function_call: Any = None  # the legacy API's call in an assistant turn: refused unless null

    # Ignored, the call vanished from the prompt and the model read its text without it.
    _no_function_call = field_validator("function_call")(refused_unless_null(
        "(the legacy function-calling API) is not supported; send the call in 'tool_calls' and its result as a "
        "tool message"))

    @field_validator("role", mode="before")
    @classmethod
    def _no_function_role(cls, value: Any) -> Any:
        # Without this, pydantic's "input should be 'system', ..." did not say what to send instead.
        if value == "function":
            raise ValueError("role 'function' (the legacy function-calling API) is not supported; "
                             "send tool messages (role 'tool' with the tool_call_id of the call)")
        return value

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if value is None:
            if role != "assistant":  # assistants may carry only tool_calls
                raise ValueError(f"content is required for a {role or 'chat'} message")
            return value
        if isinstance(value, list):
            if not value:
                raise ValueError("content must contain at least one part")
            refusals = [j for j, p in enumerate(value) if isinstance(p, dict) and p.get("type") == "refusal"]
            if refusals and role != "assistant":
                raise ValueError(f"part {refusals[0]} is a refusal part, which only assistant messages may hold")
        elif not isinstance(value, str):  # "" is valid content for every role, as in OpenAI's API
            raise ValueError("content must be a string or a list of content parts")
        return value

    @model_validator(mode="after")
    def _assistant_says_something(self) -> "ChatMessage":
        if self.role == "assistant" and self.content is None and not self.tool_calls and self.refusal is None:
            raise ValueError("an assistant message needs content or tool_calls")  # ("" is content)
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        return self

    def text(self) -> str:
        """Text and refusal parts (and an assistant's `refusal`, unless a part already says it)
        joined with newlines: what the message said, a text file's part as its text. Image parts
        and unreadable files are refused before this is called; a `refusal` on another role's message is not OpenAI's and is ignored."""
        refusal = self.refusal if self.role == "assistant" else None
        if isinstance(self.content, str):
            texts = [self.content] if self.content or refusal is None else []
        else:
            texts = [p.refusal if isinstance(p, RefusalPart) else p._text or "" if isinstance(p, FilePart) else p.text
                     for p in self.content or () if not isinstance(p, ImagePart)]
        if refusal is not None and refusal not in texts:
            texts.append(refusal)
        return "\n".join(texts)


def object_schema_problem(schema: dict[str, Any]) -> str | None:
    """Why a tool's schema cannot describe its arguments, or None. A call's arguments are a JSON
    object (both APIs refuse any other type, whatever tool_choice says); a schema with no
    `type` is taken as one of type object (tool_grammar.arguments_schema), as tierlm documents."""
    kind = schema.get("type")
    if kind is None or kind == "object" or (isinstance(kind, list) and "object" in kind):
        return None
    return f"a tool's arguments are a JSON object: the schema's type must be 'object' (got {json.dumps(kind)})"


def checked_parameters(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """A function's `parameters` (both OpenAI APIs), refused where object_schema_problem says."""
    if value is not None and (problem := object_schema_problem(value)) is not None:
        raise ValueError(problem)
    return value


class FunctionDef(_Body):
    name: str = Field(pattern=_FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None

    _object_schema = field_validator("parameters")(checked_parameters)

    # Accepted, and changes nothing: agent frameworks set it on every tool. A required or named
    # call's arguments follow `parameters` whatever it says (tool_grammar.py); under tool_choice
    # auto they are parsed JSON, never checked against it (README).
    strict: bool | None = None


class ChatTool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Body):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far (its choice's tokens)
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Body):
    name: str = Field(default="response", max_length=64)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # tierlm follows the schema either way
    description: str | None = None


class ResponseFormat(_Body):
    """OpenAI's response_format: text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("type 'json_schema' needs json_schema.schema, the JSON schema to follow")
        return self

    def params(self) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema" and self.json_schema is not None:
            return StructuredOutputsParams(json=self.json_schema.schema_)
        return None


class StructuredOutputsBody(_Body):
    """vLLM's `structured_outputs` body field (its StructuredOutputsParams' json, regex, choice
    and json_object; a grammar is refused)."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None
    grammar: Any = None

    _no_grammar = field_validator("grammar")(refused_unless_null(
        "(a grammar to follow) is not supported by tierlm; use json, regex or choice"))

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.json_, regex=self.regex,
                                       choice=self.choice,
                                       json_object=bool(self.json_object))


MAX_STOP_TOKEN_IDS = 256
MAX_N = 128  # choices per request (`n`), OpenAI's bound
# Choices of a batched completions request (prompts × n): OpenAI takes batches of up to 2,048 prompts.
MAX_BATCH_CHOICES = 2048

# vLLM's body fields tierlm cannot honour: refused by name unless neutral (null, or vLLM's
# default), with the Python API's words (sampling_params.UNSUPPORTED_VLLM_FIELDS).
_REFUSED_VLLM_FIELDS = ("guided_grammar", "use_beam_search", "spaces_between_special_tokens")


# OpenAI's chat fields tierlm cannot honour, which would change the answer's meaning if ignored
# (the answer ignoring the functions offered, no audio, no search): refused unless null (or empty).
_REFUSED_OPENAI_FIELDS = {
    "functions": "(the legacy function-calling API) is not supported; use tools and tool_choice",
    "function_call": "(the legacy function-calling API) is not supported; use tools and tool_choice",
    "audio": "(audio output) is not supported: tierlm produces text only; remove it",
    "web_search_options": "is not supported: tierlm runs no web search; pass search results in the messages",
}


def vllm_top_k(value: int | None) -> int | None:
    """vLLM's rule (OpenAI routes): -1 and 0 mean no limit; values past the vocabulary too (see
    generation.top_k_limit)."""
    if value is not None and value < -1:
        raise ValueError(f"must be -1 or 0 (no limit) or at least 1 (got {value})")
    return value


def _checked_truncation(value: int | None) -> int | None:
    if value is not None and (problem := truncate_prompt_tokens_problem(value)) is not None:
        raise ValueError(problem)
    return value


def _check_stop(value: Any) -> Any:
    stops = [value] if isinstance(value, str) else value
    if isinstance(stops, list) and (problem := stop_strings_problem(stops)) is not None:
        raise ValueError(f"the stop sequences {problem}")
    return value


class _SamplingFields(_Body):
    model: str = Field(min_length=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)  # 0: the top token only
    n: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM-style extensions
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, ge=0.01, le=10.0)  # as SamplingParams
    min_tokens: int | None = Field(default=None, ge=0)  # no EOS or stop before this many tokens
    ignore_eos: bool = False
    # vLLM's: requests with different salts never share cached prefix blocks (mixed under the tenant's)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    # Each generated token is looked up in this list: bounded like the stop strings.
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's structured outputs (engine/grammar.py): at most one of these (response_format on
    # completions too, as vLLM takes it)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: StructuredOutputsBody | None = None
    # vLLM's fields that would change the answer's meaning if ignored: refused unless null.
    guided_grammar: Any = None
    spaces_between_special_tokens: bool = True
    # vLLM's: the top N logprobs of every prompt token after the first, beside its own (scoring a
    # text); not streamed, as in vLLM
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # vLLM's: logprobs name their tokens "token_id:N" (a token that is part of a character decodes
    # to U+FFFD, so two such tokens look alike); the answer's and prompt's token ids are returned
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    # vLLM's: keep only the prompt's last N tokens (-1: the last max_model_len)
    truncate_prompt_tokens: int | None = None
    # vLLM's: sample only these tokens (ids outside the model's vocabulary are refused by the engine)
    allowed_token_ids: list[int] | None = Field(default=None, max_length=MAX_ALLOWED_TOKEN_IDS)
    # vLLM's: words never generated (tokenized by the engine, as vLLM does; bounded like the stops)
    bad_words: list[str] | None = None
    use_beam_search: bool = False

    @field_validator(*_REFUSED_VLLM_FIELDS)
    @classmethod
    def _refused_vllm_field(cls, value: Any, info: ValidationInfo) -> Any:
        if (why := unsupported_vllm_field(info.field_name, value)) is not None:
            raise ValueError(why)
        return value

    @field_validator("stream", "ignore_eos", "max_tokens", "echo", "include_stop_str_in_output",
                     "skip_special_tokens", "use_beam_search", "spaces_between_special_tokens", "add_generation_prompt",
                     "continue_final_message", "include_reasoning", "return_tokens_as_token_ids", "return_token_ids",
                     mode="before", check_fields=False)
    @classmethod
    def _null_is_the_default(cls, value: Any, info: ValidationInfo) -> Any:
        # OpenAI documents these as "... or null", meaning the default, and the `openai` SDK sends
        # null for a None argument (max_tokens=None, stream=None): they were refused as non-ints/bools.
        return cls.model_fields[info.field_name].default if value is None else value

    @field_validator("n", mode="before")
    @classmethod
    def _n_in_range(cls, value: Any) -> Any:
        # Each choice is an engine request of its own: bounded so one body cannot fill the batch.
        if isinstance(value, int) and not isinstance(value, bool) and not 1 <= value <= MAX_N:
            raise ValueError(f"must be between 1 and {MAX_N} (got {value})")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: Any) -> Any:
        return _check_stop(value)

    _top_k = field_validator("top_k")(lambda value: vllm_top_k(value))

    _truncation = field_validator("truncate_prompt_tokens")(lambda value: _checked_truncation(value))

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        # Token ids past the model's vocabulary are refused when the request is made (the engine knows it).
        if value is None:
            return value
        if len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"may hold at most {MAX_LOGIT_BIAS} entries (got {len(value)})")
        for key, bias in value.items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"keys must be token ids written as non-negative integers (got {key!r})")
            if not -100.0 <= bias <= 100.0:  # (NaN fails too)
                raise ValueError(f"values must be in [-100, 100] (got {bias} for token {key})")
        return value

    @field_validator("allowed_token_ids")
    @classmethod
    def _allowed_token_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (problem := allowed_token_ids_problem(value)) is not None:
            raise ValueError(problem)
        return value

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and (problem := bad_words_problem(value)) is not None:
            raise ValueError(problem)
        return value

    def token_bias(self) -> dict[int, float] | None:
        """`logit_bias` with its keys as token ids, as SamplingParams takes it."""
        return {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_not_streamed(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("stream"):  # (vLLM's rule)
            raise ValueError("prompt_logprobs are not available when stream is true; send the request unstreamed "
                             "(or, on /v1/completions, stream with echo and logprobs)")
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def constraints(self) -> list[tuple[str, StructuredOutputsParams]]:
        """The structured outputs this body asks for, with the field that asks (vLLM's)."""
        found = []
        if self.response_format is not None and (params := self.response_format.params()) is not None:
            found.append(("response_format", params))
        if self.guided_json is not None:
            found.append(("guided_json", StructuredOutputsParams(json=self.guided_json)))
        if self.guided_regex is not None:
            found.append(("guided_regex", StructuredOutputsParams(regex=self.guided_regex)))
        if self.guided_choice is not None:
            found.append(("guided_choice", StructuredOutputsParams(choice=self.guided_choice)))
        if self.structured_outputs is not None:
            found.append(("structured_outputs", self.structured_outputs.params()))
        return found

    def structured(self) -> tuple[str, StructuredOutputsParams] | None:
        """The one structured output asked for and the field that asks for it, or a 400 naming
        the fields that ask for two."""
        found = self.constraints()
        if len(found) > 1:
            names = " and ".join(name for name, _ in found)
            raise InvalidRequest(f"{names}: ask for one structured output, not {len(found)}; keep one of them",
                                 param=found[1][0])
        if found and (problem := found[0][1].problem()) is not None:
            raise InvalidRequest(f"{found[0][0]}: {problem}", param=found[0][0])
        return found[0] if found else None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: render the conversation without the assistant header, or continue its final
    # (assistant) message; both at once are refused, as vLLM does.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Any = None
    # vLLM's: more variables for the model's chat template (Qwen3's `enable_thinking`, ...);
    # ignored, the prompt (and the answer) differed from what the client asked for.
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None  # vLLM's: for templates that render them (RAG)
    # vLLM's: false leaves a reasoning model's reasoning out of the answer (it is still not content)
    include_reasoning: bool = True
    # vLLM's: at most this many tokens of reasoning, then the end of the think block is forced
    thinking_token_budget: int | None = Field(default=None, ge=0)
    # OpenAI's, with vLLM's values: the chat template's `reasoning_effort` (gpt-oss's template
    # writes "Reasoning: high" into its system message); a template without it renders as without
    reasoning_effort: ReasoningEffort | None = None
    # OpenAI's, refused unless neutral (see _REFUSED_OPENAI_FIELDS); modalities: ["text"] only
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    web_search_options: Any = None
    modalities: list[str] | None = None

    @field_validator(*_REFUSED_OPENAI_FIELDS)
    @classmethod
    def _refused_openai_field(cls, value: Any, info: ValidationInfo) -> Any:
        # function_call "none" / "auto" with no functions ask for nothing tierlm does not do
        neutral = value in ("none", "auto") and info.field_name == "function_call" and not info.data.get("functions")
        if value is not None and value != [] and not neutral:
            raise ValueError(f"'{info.field_name}' {_REFUSED_OPENAI_FIELDS[info.field_name]}")
        return value

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, value: list[str] | None) -> list[str] | None:
        others = sorted(set(value or ()) - {"text"})
        if others:
            raise ValueError(f"only [\"text\"] is supported: tierlm produces text only (remove {', '.join(others)})")
        return value

    _template_variables = field_validator("chat_template_kwargs")(template_kwargs_refused)

    def template_settings(self) -> tuple[bool, bool, dict[str, Any]]:
        """(add_generation_prompt, continue_final_message, the template's other variables): as
        vLLM, `chat_template_kwargs` may set the first two and `documents`, over the request's
        fields; apply_chat_template's arguments about tokenized output do not change the text,
        and are left out."""
        kwargs = dict(self.chat_template_kwargs or {})
        add = bool(kwargs.pop("add_generation_prompt", self.add_generation_prompt))
        cont = bool(kwargs.pop("continue_final_message", self.continue_final_message))
        if self.documents is not None:
            kwargs.setdefault("documents", self.documents)
        if self.reasoning_effort is not None:
            kwargs.setdefault(EFFORT_VARIABLE, self.reasoning_effort)
        return add, cont, template_variables(kwargs)

    @field_validator("continue_final_message")
    @classmethod
    def _not_with_generation_prompt(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("add_generation_prompt", True):
            raise ValueError("cannot be true while add_generation_prompt is true (its default); "
                             "set add_generation_prompt to false to continue the final message")
        return value

    _no_custom_template = field_validator("chat_template", mode="before")(refused_unless_null(
        "a custom chat template is not supported by tierlm (the model's own is used); remove it"))

    @field_validator("messages")
    @classmethod
    def _some_messages(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise ValueError("messages must contain at least one message")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_names_a_tool(cls, value: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools") or []
        if value == "required" and not tools:
            raise ValueError("tool_choice 'required' needs a non-empty 'tools' list")
        if isinstance(value, NamedToolChoice):
            names = [t.function.name for t in tools]
            if value.function.name not in names:
                raise ValueError(f"tool_choice names function '{value.function.name}', not in tools {names}")
        return value

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def _one_prompt(value: Any, where: str) -> str | list[int]:
    """One prompt: a non-empty string or list of token ids."""
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    if value == "" or value == []:
        raise ValueError(f"{where} must not be empty")
    raise ValueError(f"{where} must be a string or a list of token ids")


def _prompt_batch(value: Any, field_name: str, most: int, too_many: Callable[[int], str]) -> Any:
    """A string, token ids, or a batch of at most `most` of either, each checked (a
    one-element batch is one prompt); `too_many(count)` says why a larger batch is refused."""
    batch = isinstance(value, list) and bool(value) and all(isinstance(p, (str, list)) for p in value)
    if not batch:
        return _one_prompt(value, field_name)
    if len(value) == 1:
        return _one_prompt(value[0], field_name)
    if len(value) > most:
        raise ValueError(too_many(len(value)))
    return [_one_prompt(p, f"{field_name}.{i}") for i, p in enumerate(value)]


def _batch_items(value: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """A validated prompt field's prompts: one, or each of a batch."""
    batch = isinstance(value, list) and isinstance(value[0], (str, list))
    return list(value) if batch else [value]  # type: ignore[list-item]


class CompletionRequest(_SamplingFields):
    # One prompt, or a batch of them (strings or token-id lists): each batched prompt gets its
    # n choices, prompt i's numbered i × n to i × n + n − 1, as OpenAI and vLLM number them.
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = Field(default=16, ge=0)  # 0 with echo only: the prompt scored, nothing generated (vLLM's)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, value: Any, info: ValidationInfo) -> Any:
        n = info.data.get("n") or 1  # each choice is an engine request, as with n
        return _prompt_batch(value, "prompt", MAX_BATCH_CHOICES // n,
                             lambda k: f"a batch of {k} prompts with n={n} is {k * n} choices; at most "
                                       f"{MAX_BATCH_CHOICES} per request: split the batch")

    def prompts(self) -> list[str | list[int]]:
        """The body's prompts, one or a batch."""
        return _batch_items(self.prompt)

    @model_validator(mode="after")
    def _nothing_generated_only_with_echo(self) -> "CompletionRequest":
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequest("max_tokens must be at least 1, or 0 with echo (the prompt alone, scored with "
                                 "logprobs)", param="max_tokens")
        return self

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix (fill-in-the-middle) is not supported by tierlm; remove it")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_one(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n") or 1
        if value is not None and value < n:  # as OpenAI: the best of fewer than n cannot give n
            raise ValueError(f"best_of must be greater than or equal to n, got n={n} and best_of={value}")
        if value is not None and value != n:  # best_of == n picks nothing: the n choices themselves
            raise ValueError(f"only best_of equal to n is supported (got best_of={value}, n={n})")
        return value


MAX_EMBEDDING_INPUTS = 2048  # OpenAI's bound on one request's inputs


class EmbeddingRequest(_Body):
    """OpenAI's /v1/embeddings body, with vLLM's `truncate_prompt_tokens`, `normalize` and `cache_salt`."""

    model: str = Field(min_length=1)
    input: str | list[int] | list[str] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    normalize: bool = True
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)

    _nulls = field_validator("encoding_format", "normalize", mode="before")(  # null: the default (the SDKs' None)
        lambda value, info: EmbeddingRequest.model_fields[info.field_name].default if value is None else value)

    @field_validator("input", mode="before")
    @classmethod
    def _inputs(cls, value: Any) -> Any:
        return _prompt_batch(value, "input", MAX_EMBEDDING_INPUTS,
                             lambda k: f"holds {k} inputs; at most {MAX_EMBEDDING_INPUTS} per request: split it")

    _truncation = field_validator("truncate_prompt_tokens")(lambda value: _checked_truncation(value))

    def inputs(self) -> list[str | list[int]]:
        return _batch_items(self.input)


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # a base64 string of little-endian float32s with encoding_format base64


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


# ---- responses -------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None  # {"cached_tokens": N}


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ResponseMessage(BaseModel):
    # The reasoning, where there is some, as vLLM gives it: `reasoning_content` and its newer
    # name `reasoning` (extra fields, so an answer without reasoning has neither)
    model_config = ConfigDict(extra="allow")

    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None  # OpenAI's fields; tierlm models never refuse or annotate
    annotations: list[Any] = Field(default_factory=list)
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(BaseModel):
    model_config = ConfigDict(extra="allow")  # vLLM's token_ids, only when asked for

    index: int = 0
    message: ResponseMessage
    finish_reason: Literal["stop", "length", "tool_calls", "content_filter"] | None
    logprobs: dict[str, Any] | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id matched (None: EOS, a limit)


class ChatCompletion(BaseModel):
    model_config = ConfigDict(extra="allow")  # vLLM's prompt_logprobs, prompt_token_ids, only when asked for

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class CompletionChoice(BaseModel):
    model_config = ConfigDict(extra="allow")  # vLLM's prompt_logprobs, token_ids, prompt_token_ids when asked for

    index: int = 0
    text: str
    finish_reason: Literal["stop", "length", "content_filter"] | None
    logprobs: dict[str, Any] | None = None
    stop_reason: str | int | None = None  # (as ChatChoice's)


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None
