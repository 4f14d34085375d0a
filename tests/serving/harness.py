"""What the serving tests share: the production server in a thread, SSE parsing, and ways to
watch or disturb a real engine (record what it was asked, slow its steps, make a step fail)."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import uvicorn

from tierlm.engine.request import Request
from tierlm.serving.server import make_server

API_KEY = "sk-tierlm-test-key"
SMALL_BODY_LIMIT = 256 * 1024


@dataclass
class ServerThread:
    """The production server (`make_server`) on 127.0.0.1, a free port, in a background thread.

    `stop()` does what SIGTERM does (signals only reach the main thread).
    """

    app: Any
    graceful_timeout: float = 5.0
    send_buffer: int | None = None  # SO_SNDBUF of accepted connections (default: the kernel's, up to MBs)
    server: uvicorn.Server = field(init=False)
    thread: threading.Thread = field(init=False)
    port: int = field(init=False)

    def __post_init__(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # asyncio only sets TCP_NODELAY on sockets created with proto=IPPROTO_TCP (as uvicorn's
        # own binding does); without it every response waits ~40 ms for a delayed ACK.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.send_buffer is not None:  # accepted sockets inherit it
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._socket = sock
        self.server = make_server(self.app, shutdown_timeout=self.graceful_timeout, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the test server thread died while starting; see the log above")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the test server did not start within {timeout}s")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self._socket.close()


def sdk_clients(url: str, api_key: str = API_KEY) -> tuple[Any, Any]:
    """The official anthropic and openai clients for a test server (no retries: a failure shows)."""
    import anthropic
    import openai
    return (anthropic.Anthropic(base_url=url, api_key=api_key, max_retries=0, timeout=60),
            openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=60))


def tenants_file(tiers: dict[str, str]) -> str:
    """A tenants file's text: one tenant per key id (`tiers`: key id -> tier), named as its key."""
    return "".join(f'[tenants.{key}]\ntier = "{tier}"\nkeys = ["{key}"]\n' for key, tier in tiers.items())


def output_policies_file(policies: list[tuple[str, list[str], str, str]], whole_word: bool = False) -> str:
    """A policies file's text: one output policy per (name, phrases, action, tenant), each
    redaction replacing with "[x]"."""
    return "".join(
        f'[policies.{name}]\nphrases = {json.dumps(phrases)}\ncheck = "output"\naction = "{action}"\n'
        f'replacement = "[x]"\ntenants = ["{tenant}"]\nwhole_word = {json.dumps(whole_word)}\n'
        for name, phrases, action, tenant in policies)


def guarded_server(root: Any, engines: dict[str, Any], keys: dict[str, str], tenants: str,
                   policies: str) -> ServerThread:
    """A started server over `engines` whose tenants (`keys`: key id -> key) and safety policies
    are these files' texts (written under `root`)."""
    from tierlm.serving.app import build_app
    from tierlm.serving.auth import ApiKeyAuth
    from tierlm.serving.safety import SafetyPolicies
    from tierlm.serving.tenancy import Tenancy

    (root / "tenants.toml").write_text(tenants)
    (root / "policies.toml").write_text(policies)
    tenancy = Tenancy.from_file(root / "tenants.toml", keys)
    safety = SafetyPolicies.from_file(root / "policies.toml", tiers=set(tenancy.config.tiers),
                                      tenants=set(tenancy.config.tenants))
    return ServerThread(build_app(engines, ApiKeyAuth.from_keys(keys), tenancy=tenancy, safety=safety)).start()


def assert_cut_off_is_all_thinking(claude: Any, model: str, messages: list, thought: str, max_tokens: int) -> None:
    """An Anthropic answer cut off by max_tokens while the model reasons is one thinking block,
    the start of `thought`, streamed as it is whole."""
    done = claude.messages.create(model=model, max_tokens=max_tokens, messages=messages)
    assert [b.type for b in done.content] == ["thinking"] and done.stop_reason == "max_tokens"
    assert thought.startswith(done.content[0].thinking) and done.content[0].thinking
    with claude.messages.stream(model=model, max_tokens=max_tokens, messages=messages) as stream:
        assert stream.get_final_message().model_dump(exclude={"id"}) == done.model_dump(exclude={"id"})


def parse_sse(raw: str) -> list[tuple[str | None, Any]]:
    """(event name, decoded data) per frame; `[DONE]` stays a string."""
    frames = []
    for block in raw.strip().split("\n\n"):
        event, data = None, None
        for line in block.split("\n"):
            if line.startswith("event: "):
                event = line[len("event: "):]
            elif line.startswith("data: "):
                payload = line[len("data: "):]
                data = payload if payload == "[DONE]" else json.loads(payload)
        frames.append((event, data))
    return frames


async def until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    """Wait, in an event loop, until `condition()` holds (an assertion error past `timeout`)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


# ---- watching and disturbing a real AsyncEngine -------------------------------------------


def record_requests(engine: Any, monkeypatch: pytest.MonkeyPatch) -> list[Request]:
    """Every request the engine admits from now on (prompt ids, SamplingParams, id), as built by
    the engine itself; the engine runs unchanged."""
    calls: list[Request] = []
    make_request = engine.engine.make_request

    def recording(*args: Any, **kwargs: Any) -> Request:
        request = make_request(*args, **kwargs)
        calls.append(request)
        return request

    monkeypatch.setattr(engine.engine, "make_request", recording)
    return calls


def slow_steps(engine: Any, monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Every engine step takes at least `seconds` longer (a slow device), so that a request is
    still running when the test acts on it."""
    execute = engine.engine.runner.execute

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return execute(*args, **kwargs)

    monkeypatch.setattr(engine.engine.runner, "execute", slow)


def fail_after_steps(engine: Any, monkeypatch: pytest.MonkeyPatch, steps: int) -> None:
    """The model forward raises from step `steps + 1` on (a device fault); the engine then
    fails every request in flight, as it would on real hardware errors."""
    execute = engine.engine.runner.execute
    done = [0]

    def failing(*args: Any, **kwargs: Any) -> Any:
        done[0] += 1
        if done[0] > steps:
            raise RuntimeError("injected device fault")
        return execute(*args, **kwargs)

    monkeypatch.setattr(engine.engine.runner, "execute", failing)
