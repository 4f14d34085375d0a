"""Anthropic's Files API (tierlm/serving/files.py, beside OpenAI's at the same routes) through the
official `anthropic` SDK against a real server: uploads, metadata, cursor pages, deletion, per
key and apart from OpenAI's files; and an uploaded text file used as a message's document,
which reads exactly as the same text sent inline."""
from __future__ import annotations

import time

import anthropic
import httpx
import openai
import pytest

from tests.serving.harness import ServerThread
from tests.serving.scripted_model import REPLY, TEXT_MODEL
from tierlm.serving.app import build_app
from tierlm.serving.auth import ApiKeyAuth

KEYS = {"a": "sk-afiles-a", "b": "sk-afiles-b"}
NOTES = "The quarterly numbers: revenue up, costs flat.\nAsk about margins.\n"


@pytest.fixture(scope="module")
def server(scripted_models):
    srv = ServerThread(build_app({TEXT_MODEL: scripted_models[TEXT_MODEL].engine(TEXT_MODEL)},
                                 ApiKeyAuth.from_keys(KEYS))).start()
    yield srv
    srv.stop()


def client(server: ServerThread, key: str = "a") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEYS[key], max_retries=0, timeout=60)


def ask(document_source: dict, **extra) -> dict:
    return {"model": TEXT_MODEL, "max_tokens": 50, "messages": [{"role": "user", "content": [
        {"type": "document", "source": document_source, "title": "Notes"},
        {"type": "text", "text": "What should I ask about?"}]}], **extra}


def test_uploads_are_listed_paged_per_key_and_deleted(server):
    a, b = client(server, "a"), client(server, "b")
    started = time.time()
    first = a.beta.files.upload(file=("notes.txt", NOTES.encode(), "text/plain"))
    second = a.beta.files.upload(file=("dir/data.json", b'{"x": 1}'), expires_in_seconds=3600)
    assert first.id.startswith("file_") and first.type == "file" and first.filename == "notes.txt"
    assert (first.mime_type, first.size_bytes, first.downloadable, first.expires_at) == \
        ("text/plain", len(NOTES.encode()), False, None)
    assert abs(first.created_at.timestamp() - started) < 5
    assert second.filename == "data.json" and second.mime_type == "application/json"  # (guessed from the name)
    assert (second.expires_at - second.created_at).total_seconds() == pytest.approx(3600, abs=1)
    page = a.beta.files.list(limit=1)
    assert [f.id for f in page.data] == [second.id] and page.next_page == second.id
    assert [f.id for f in a.beta.files.list(limit=1)] == [second.id, first.id]  # every page, newest first
    assert a.beta.files.retrieve_metadata(first.id).filename == "notes.txt"
    assert list(b.beta.files.list()) == []
    with pytest.raises(anthropic.NotFoundError) as missing:
        b.beta.files.retrieve_metadata(first.id)  # another key's file is not found
    assert missing.value.body["type"] == "error" and "not found" in missing.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="cannot be downloaded"):
        a.beta.files.download(first.id)  # uploads are not downloadable, as in Anthropic's API
    o = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS["a"], max_retries=0, timeout=60)
    assert first.id not in [f.id for f in o.files.list()]  # each API its own files
    with pytest.raises(openai.NotFoundError):
        o.files.retrieve(first.id)
    theirs = o.files.create(file=("x.jsonl", b"{}\n"), purpose="batch")
    assert theirs.id not in [f.id for f in a.beta.files.list()]
    with pytest.raises(anthropic.NotFoundError):
        a.beta.files.retrieve_metadata(theirs.id)
    deleted = a.beta.files.delete(second.id)
    assert deleted.id == second.id and deleted.type == "file_deleted"
    with pytest.raises(anthropic.NotFoundError):
        a.beta.files.retrieve_metadata(second.id)
    assert [f.id for f in a.beta.files.list()] == [first.id]


@pytest.mark.parametrize("form, says", [
    ({"data": {"expires_in_seconds": "60"}, "files": {"file": ("n.txt", b"x")}}, "expires_in_seconds: must be an "
                                                                                 "integer from 3600"),
    ({"files": {"other": ("n.txt", b"x")}}, "file: the form has no file"),
    ({"json": {"file": "x"}}, "upload a file as multipart/form-data with the field 'file'"),
])
def test_a_bad_upload_is_refused_in_anthropics_shape(server, form, says):
    headers = {"x-api-key": KEYS["b"], "anthropic-version": "2023-06-01"}
    r = httpx.post(server.url + "/v1/files", headers=headers, **form)
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error" and says in r.json()["error"]["message"]
    assert list(client(server, "b").beta.files.list()) == []


def test_an_uploaded_text_file_reads_as_the_same_text_inline(server):
    a = client(server, "a")
    notes = a.beta.files.upload(file=("notes.md", NOTES.encode(), "text/markdown"))
    inline = a.messages.create(**ask({"type": "text", "media_type": "text/plain", "data": NOTES}))
    from_file = a.messages.create(**ask({"type": "file", "file_id": notes.id}))
    assert from_file.content[0].text == REPLY and from_file.content == inline.content
    def total(usage) -> int:
        return usage.input_tokens + usage.cache_read_input_tokens

    # the very same prompt: as long, and all but its last token read from the inline one's cache
    assert total(from_file.usage) == total(inline.usage) and from_file.usage.cache_read_input_tokens >= \
        total(inline.usage) - 16
    assert a.messages.count_tokens(**{k: v for k, v in ask({"type": "file", "file_id": notes.id}).items()
                                      if k != "max_tokens"}).input_tokens == total(inline.usage)
    in_tool_result = {"model": TEXT_MODEL, "max_tokens": 50, "messages": [
        {"role": "user", "content": "Read the notes"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "document", "source": {"type": "file", "file_id": notes.id}}]}]}],
        "tools": [{"name": "read", "description": "read the notes", "input_schema": {"type": "object"}}]}
    assert a.messages.create(**in_tool_result).content[0].text == REPLY
    batch = a.messages.batches.create(requests=[{"custom_id": "doc", "params": ask({"type": "file",
                                                                                    "file_id": notes.id})}])
    deadline = time.monotonic() + 60
    while a.messages.batches.retrieve(batch.id).processing_status != "ended":  # run as its creator: its files
        assert time.monotonic() < deadline
        time.sleep(0.05)
    result = next(iter(a.messages.batches.results(batch.id))).result
    assert result.type == "succeeded" and total(result.message.usage) == total(inline.usage)


def test_a_file_the_model_cannot_read_or_that_is_not_there_is_a_400_naming_the_block(server):
    a = client(server, "a")
    pdf = a.beta.files.upload(file=("r.pdf", b"%PDF-1.4 ...", "application/pdf"))
    binary = a.beta.files.upload(file=("b.txt", b"\xff\xfe\x00bad", "text/plain"))  # text/plain, not UTF-8
    for file_id, says in ((pdf.id, "document blocks other than plain text (this one's source is 'file')"),
                          (binary.id, "document blocks other than plain text"),
                          ("file_nope", "messages.0.content.0.source.file_id: file 'file_nope' not found")):
        with pytest.raises(anthropic.BadRequestError) as refused:
            a.messages.create(**ask({"type": "file", "file_id": file_id}))
        assert says in refused.value.body["error"]["message"], refused.value.body
    other = client(server, "b")
    with pytest.raises(anthropic.BadRequestError, match="not found"):  # another key's file
        other.messages.create(**ask({"type": "file", "file_id": pdf.id}))
    openai_file = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS["a"], max_retries=0).files.create(
        file=("n.txt", NOTES.encode()), purpose="user_data")
    with pytest.raises(anthropic.BadRequestError, match="not found"):  # OpenAI's Files API's: not Anthropic's
        a.messages.create(**ask({"type": "file", "file_id": openai_file.id}))
