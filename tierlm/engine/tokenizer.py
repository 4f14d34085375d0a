"""Tokenizer loading and chat-template rendering (local files only)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tierlm.errors import ChatTemplateError, InvalidRequestError, ModelLoadError


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        raise ModelLoadError(f"no tokenizer files (tokenizer.json / tokenizer_config.json) in {model_dir}; "
                             "save the tokenizer next to the weights with tokenizer.save_pretrained(dir)")
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:  # transformers raises many types here; all mean the same to a user
        raise ModelLoadError(f"cannot load the tokenizer from {model_dir}: {e}") from None


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                template_kwargs: dict | None = None) -> list[int]:
    """Render messages through the tokenizer's chat template and tokenize the result."""
    return encode_rendered(tokenizer, render_chat_text(tokenizer, messages, tools, add_generation_prompt,
                                                       continue_final_message, template_kwargs))


def encode_rendered(tokenizer, text: str) -> list[int]:
    """A rendered chat's token ids: the template wrote the special tokens itself."""
    return tokenizer.encode(text, add_special_tokens=False)


def render_chat_text(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                     add_generation_prompt: bool = True, continue_final_message: bool = False,
                     template_kwargs: dict | None = None) -> str:
    """Messages through the tokenizer's chat template, as text (what `render_chat` tokenizes).
    `template_kwargs` are more variables for the template (vLLM's `chat_template_kwargs`, e.g.
    Qwen3's `enable_thinking`); they cannot replace the arguments above."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            "this model's tokenizer has no chat template, so chat requests cannot be rendered; "
            "use a plain completion prompt or add a chat_template to tokenizer_config.json", param="messages")
    if not messages:
        raise InvalidRequestError("messages must not be empty", param="messages")
    for name, value in (("messages", messages), ("tools", tools), ("chat_template_kwargs", template_kwargs)):
        _refuse_deep_nesting(value, name)
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message, **(template_kwargs or {}))
    except RecursionError:  # a template recursing on its own, not on the depth checked above
        raise InvalidRequestError("the chat template could not render these messages: they are nested too "
                                  "deeply for it", param="messages") from None
    except Exception as e:  # jinja errors: the template rejected these messages
        raise InvalidRequestError(f"the chat template could not render these messages: {e}", param="messages") from None
    return text


# How deeply the values a chat template sees may nest (a tool's JSON schema, a tool call's
# arguments). Templates walk them recursively (tojson, macros): 900 levels hit Python's recursion
# limit, whose message ("maximum recursion depth exceeded") is no answer for a client. A schema
# object is two levels (it and its `properties`): 256 is 128 schema levels, where the demo
# template renders 200 (400 levels) and fails at 300.
MAX_TEMPLATE_DEPTH = 256


def _refuse_deep_nesting(value: Any, name: str, limit: int = MAX_TEMPLATE_DEPTH) -> None:
    """A 400 naming `name` when `value` nests lists/dicts more than `limit` deep (walked iteratively)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        current, depth = stack.pop()
        if isinstance(current, (dict, list, tuple)):
            if depth >= limit:
                raise InvalidRequestError(f"{name}: nested too deeply (limit {limit} levels of objects and arrays)",
                                          param=name)
            children = current.values() if isinstance(current, dict) else current
            stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list, tuple)))
