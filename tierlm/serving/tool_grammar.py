"""A required tool call's grammar: the call tierlm started, finished on the tool's schema.

tool_choice `required` or a named function (Anthropic's `any` / `tool`) starts the answer with a
call in the model's syntax (ToolCallSyntax.forced_prefix: `<tool_call>\\n`, and the name where the
tool is named). As vLLM's guided decoding does for those choices, the rest is then constrained
token by token (engine/grammar.py): a grammar in llguidance's Lark dialect that writes the rest
of exactly one call to an offered tool (the named one), its arguments following the tool's JSON
schema (embedded with `%json`, compact as structured outputs write JSON), and then nothing but
the end of the answer. So whatever the model writes, the call parses with the syntax's own parser
into that call; only a cut (max_tokens, a stop string) can leave it unfinished, as text.

One call, even where the client allows parallel calls: vLLM's `required` lets a model write a
list of calls, but one is what a named choice means, and what every syntax here can close
without guessing where a list ends. A call under tool_choice `auto` is not constrained (nor is it
in vLLM): the model may answer in prose, and its calls are parsed as written.
"""
from __future__ import annotations

import asyncio
import json
import re
from typing import TYPE_CHECKING, Any

from tierlm.engine.grammar import COMPACT_JSON, inexact_integer
from tierlm.errors import TierlmError
from tierlm.sampling_params import StructuredOutputsParams
from tierlm.serving.errors import InvalidRequest
from tierlm.serving.protocol_openai import object_schema_problem
from tierlm.serving.tools import ToolCallFormat

if TYPE_CHECKING:
    from tierlm.engine.async_engine import AsyncEngine


def arguments_schema(schema: Any, field: str) -> dict[str, Any]:
    """A tool's parameters as the schema its call's arguments follow: a JSON object (the parsers
    take nothing else as arguments), compact, and lenient: keywords llguidance does not implement
    (`uniqueItems`, `not`, `if`, an unknown `format`, ... common in MCP and zod schemas) are not
    enforced rather than refused (a client's own `x-guidance` is dropped: it could allow spacing
    or separators the call's parser does not read). No schema (OpenAI's parameters left out) is
    any object; a schema with no `type` is one of type object; one whose type cannot be an
    object, or holding an integer past +-2**53 (engine/grammar.py's inexact_integer), is a 400
    naming `field`."""
    if schema is None:
        schema = {}
    if object_schema_problem(schema) is None:
        schema = {**schema, "type": "object"}
    else:
        raise InvalidRequest(f"{field}: a required call's arguments are a JSON object, and this schema's type "
                             f"is {json.dumps(schema.get('type'))}; give a schema of type object, or use "
                             "tool_choice 'auto'", param=field)
    if problem := inexact_integer(schema):  # (not lenient: the call would silently break it)
        raise InvalidRequest(f"{field}: a required call cannot follow this schema ({problem}); fix the schema, or "
                             "use tool_choice 'auto', whose calls are not constrained", param=field)
    return {**schema, "x-guidance": {**COMPACT_JSON, "lenient": True}}


def call_lark(fmt: ToolCallFormat, tools: list[tuple[str, dict[str, Any]]], written: str) -> str:
    """The Lark grammar of the rest of one call to one of `tools` ((name, arguments schema)),
    after `written`, the start of it that the prompt ends with."""
    tokens = dict(fmt.marker_tokens)
    rules = []
    for i, (name, schema) in enumerate(tools):
        head, tail = fmt.syntax.call_parts(name)
        if not head.startswith(written):  # (a start naming another tool: a bug, not the client's)
            raise ValueError(f"the call start {written!r} does not begin a call to {name!r}")
        body = [_lark_text(head[len(written):], tokens), "%json " + json.dumps(schema), _lark_text(tail, tokens)]
        rules.append(f"call_{i}: " + " ".join(p for p in body if p))
    return "start: " + " | ".join(f"call_{i}" for i in range(len(tools))) + "\n" + "\n".join(rules) + "\n"


def _lark_text(text: str, tokens: dict[str, int]) -> str:
    """`text` as Lark: string literals, and each marker that is one token here as that token
    (`<[id]>`: a special token's text in ordinary tokens is not the marker the model learnt)."""
    if not text:
        return ""
    if not tokens:
        return json.dumps(text)
    pieces = []
    for part in re.split("(" + "|".join(map(re.escape, tokens)) + ")", text):
        if part in tokens:
            pieces.append(f"<[{tokens[part]}]>")
        elif part:
            pieces.append(json.dumps(part))
    return " ".join(pieces)


async def call_grammar(engine: "AsyncEngine", fmt: ToolCallFormat, tools: list[dict[str, Any]],
                       tool_name: str | None, written: str, schema_field: str) -> StructuredOutputsParams | None:
    """The constraint on a required call (tools in chat-template form; `tool_name` the named one,
    None for any; `written` the call's start at the prompt's end), compiled on a worker thread
    (and kept for the request), or None where grammars cannot be followed here (llguidance
    cannot take a slow tokenizer): the call is then only started, as before tierlm constrained
    it. A schema llguidance cannot follow is a 400 naming it (`schema_field` with the tool's
    index: "tools.{}.input_schema")."""
    grammars = engine.engine.grammars
    if not await asyncio.to_thread(grammars.available):
        return None
    named: dict[str, int] = {}
    for i, t in enumerate(tools):  # (a call's name must say which schema its arguments follow)
        if (j := named.setdefault(t["function"]["name"], i)) != i:
            where = ".".join(schema_field.format(i).split(".")[:2])
            raise InvalidRequest(f"{where}: two tools are named '{t['function']['name']}' (the other is tool {j}); a "
                                 "required call must know which schema it follows: rename one", param=where)
    chosen = [(i, t["function"]) for i, t in enumerate(tools)
              if tool_name is None or t["function"]["name"] == tool_name]
    schemas = [(f["name"], arguments_schema(f.get("parameters"), schema_field.format(i))) for i, f in chosen]
    spec = StructuredOutputsParams(lark=call_lark(fmt, schemas, written))
    try:
        await asyncio.to_thread(grammars.grammar, spec)
    except TierlmError as whole:
        for (i, _), one in zip(chosen, schemas):  # which tool's schema: each alone (only once one failed)
            try:
                await asyncio.to_thread(grammars.grammar, StructuredOutputsParams(lark=call_lark(fmt, [one], written)),
                                        False)  # (a diagnosis: kept out of the cache other requests share)
            except TierlmError as exc:
                raise _unfollowable(schema_field.format(i), exc) from None
        raise _unfollowable("tools", whole) from None
    return spec


def _unfollowable(field: str, exc: Exception) -> InvalidRequest:
    problem = str(exc).removeprefix("structured_outputs: ").removeprefix("this grammar cannot be followed: ")
    problem = re.sub(r"^at \d+\(\d+\): ", "", problem)  # (where in tierlm's grammar: nothing the client wrote)
    return InvalidRequest(f"{field}: a required call cannot follow this schema ({problem}); fix the schema, or use "
                          "tool_choice 'auto', whose calls are not constrained", param=field)
