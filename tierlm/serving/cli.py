"""`tierlm serve`: the HTTP server from the command line.

    tierlm serve                                  # the built-in demo model, on 127.0.0.1:8000
    tierlm serve /models/qwen --port 9000 --api-keys keys.txt
    tierlm serve --model small=/models/a --model big=/models/b --host 0.0.0.0 --api-keys keys.txt

Without --api-keys the server only starts without auth on a loopback host (or with an
explicit --no-auth), and says so loudly: an open port with no keys serves anyone.
"""
from __future__ import annotations

import argparse
import gc
import ipaddress
import json
import time
import logging
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tierlm.engine.async_engine import AsyncEngine
    from tierlm.serving.auth import Authenticator
    from tierlm.serving.lora_admin import LoRAUpdates

from tierlm.cli import _add_engine_args, at_least, engine_kwargs
from tierlm.serving.files import DEFAULT_MAX_FILE_BYTES
from tierlm.serving.response_store import DEFAULT_MAX_BYTES, ResponseStore
from tierlm.serving.reasoning import PARSERS as REASONING_PARSERS
from tierlm.serving.sse import DEFAULT_STREAM_SEND_TIMEOUT
from tierlm.serving.validation import DEFAULT_MAX_BODY_BYTES, DEFAULT_REQUEST_READ_TIMEOUT

logger = logging.getLogger("tierlm.serving")

NO_AUTH_BANNER = (
    "!" * 78 + "\n"
    "!!  AUTHENTICATION IS OFF: anyone who can reach {where} can use this server.\n"
    "!!  Use --api-keys FILE for anything but local experiments.\n" + "!" * 78 + "\n"
)


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text} is not a TCP port (0-65535)")
    return port


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve",
        help="serve models over HTTP (Anthropic Messages + OpenAI APIs)",
        conflict_handler="resolve",  # our --model (NAME=DIR, repeatable) replaces the engine one
    )
    _add_engine_args(p)
    p.add_argument("model_dir", nargs="?", default=None,
                   help="Hugging Face checkpoint directory (default: the built-in demo model)")
    p.add_argument("--model", dest="models", action="append", default=[], metavar="NAME=DIR",
                   help="serve DIR under the name NAME (repeat for several models, each with its own engine)")
    p.add_argument("--lora-modules", nargs="+", action="extend", default=[], metavar="NAME=DIR",
                   help="LoRA adapters (PEFT directories) to serve, each a model of its own name on the base "
                        "model (implies --enable-lora); with several models served, give each as JSON naming its "
                        "base, vLLM's form: '{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="serve vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (implies "
                        "--enable-lora); with --api-keys, only the --lora-admin-key ids may call them")
    p.add_argument("--lora-admin-key", dest="lora_admin_keys", action="append", default=[], metavar="KEY_ID",
                   help="a key id (from --api-keys) that may load and unload adapters at run time; repeat for more")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8000, help="0 picks a free port (the log says which)")
    auth = p.add_mutually_exclusive_group()
    auth.add_argument("--api-keys", metavar="FILE", default=None,
                      help="file of '<key-id> sha256:<hex>' lines (see `python -m tierlm.serving.auth`)")
    auth.add_argument("--no-auth", action="store_true", help="accept requests without API keys (local use only)")
    p.add_argument("--tenants", metavar="FILE", default=None,
                   help="TOML file grouping the --api-keys key ids into tenants, each with a tier (gold, silver, "
                        "bronze: the engine's priority) and optional limits (requests_per_minute, "
                        "tokens_per_minute, max_concurrent); see README 'Tenants' (default: each key a tenant "
                        "of its own, no limits)")
    p.add_argument("--limits-store", metavar="URL", default=None,
                   help="a Redis (redis://HOST:PORT/DB) that every server serving these tenants shares: each "
                        "tenant's requests_per_minute, tokens_per_minute and max_concurrent then hold across all "
                        "of them, not per server (needs --tenants; while it does not answer, each server limits "
                        "on its own)")
    p.add_argument("--batches-dir", metavar="DIR", default=None,
                   help="where batches (Anthropic's /v1/messages/batches, OpenAI's /v1/batches), their results "
                        "and OpenAI's files (/v1/files, in DIR/files) are written as they run, so that a restarted "
                        "server has them and goes on with what had not finished (default: in memory only); one "
                        "server per directory")
    p.add_argument("--files-max-bytes", type=at_least(1, int), default=DEFAULT_MAX_FILE_BYTES, metavar="N",
                   help="the most bytes OpenAI's files (/v1/files: batches' input, output and error files) may hold "
                        "on this server in all; an upload past it is refused until files are deleted (default: "
                        "%(default)s, 1 GiB)")
    p.add_argument("--safety-policies", metavar="FILE", default=None,
                   help="TOML file of phrase policies checked on prompts and answers as they stream: block "
                        "(refusal / content_filter) or redact, per tier or tenant; see README 'Safety policies'")
    p.add_argument("--fallback-model", dest="fallback_models", action="append", default=[], metavar="BIG=SMALL",
                   help="serve with model SMALL what the SLA guard refuses for model BIG (its estimate or its "
                        "breaker says the tier's ttft_target_ms would be missed), where SMALL's guard admits it; "
                        "both must be served (--model), repeat for several; see README 'SLA guard'")
    p.add_argument("--sla-breaker", action=argparse.BooleanOptionalAction, default=True,
                   help="refuse a tier's requests to a model for a cool-down once half of its last 8-20 missed "
                        "their ttft_target_ms (tiers without a target are never refused; a tier's own `breaker` "
                        "in the tenants file overrides this)")
    p.add_argument("--max-body-bytes", type=at_least(1, int), default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get 413 request_too_large")
    p.add_argument("--request-read-timeout", type=at_least(0, float), default=DEFAULT_REQUEST_READ_TIMEOUT,
                   metavar="SECONDS",
                   help="a client has this long to send a request's headers (after connecting or after its "
                        "previous response), and each part of its body after the last; then the connection is "
                        "closed (the body with a 408). 0: no limit (default: %(default)g)")
    p.add_argument("--stream-send-timeout", type=at_least(0, float), default=DEFAULT_STREAM_SEND_TIMEOUT,
                   metavar="SECONDS",
                   help="a streaming client whose one write has waited this long (it stopped reading, or reads "
                        "under ~48 KiB in that time while far behind) has its request aborted and its connection "
                        "closed. 0: no limit (default: %(default)g)")
    p.add_argument("--tool-call-parser", choices=["auto", "hermes", "llama3_json", "mistral", "harmony", "openai"],
                   default="auto",
                   help="how the models write tool calls: hermes (<tool_call>{...}</tool_call>: Hermes, Qwen), "
                        "llama3_json (an answer of {\"name\": ..., \"parameters\": ...} objects, ';'-separated, "
                        "after an optional <|python_tag|>: Llama 3.1-3.3), mistral ([TOOL_CALLS] and a JSON list, "
                        "or name[ARGS]{...}), harmony (or vLLM's openai: gpt-oss's messages to=functions.NAME); "
                        "auto: each model's chat template says which (<|channel|> and <|message|>, <tool_call>, "
                        "[TOOL_CALLS], <|python_tag|> or ipython), hermes if it shows none. The choice is logged "
                        "at start (default: %(default)s)")
    p.add_argument("--reasoning-parser", choices=list(REASONING_PARSERS), default="auto",
                   help="read the think block a reasoning model writes before its answer (<think>...</think>: "
                        "Qwen3, DeepSeek-R1, SmolLM3) as reasoning: Anthropic thinking blocks, OpenAI "
                        "reasoning_content (vLLM's field). think (or vLLM's qwen3): always; deepseek_r1: always, and every "
                        "answer starts inside the block, as vLLM's parser of that name reads R1; harmony (or "
                        "vLLM's openai_gptoss): gpt-oss's analysis channel; none: answers are all text; auto: "
                        "harmony for each model whose chat template or vocabulary has <|channel|> and "
                        "<|message|>, think for each whose template writes <think> or </think>. The choice is "
                        "logged at start (default: %(default)s)")
    p.add_argument("--responses-store-mb", type=at_least(0, float), default=DEFAULT_MAX_BYTES / 2**20,
                   help="MiB of JSON the Responses API may keep of stored responses (store true: "
                        "previous_response_id, GET /v1/responses/ID; Python holds a few times that); past it the "
                        "API key holding the most loses its least recently used first; 0 keeps none "
                        "(default: %(default)g)")
    p.add_argument("--shutdown-timeout", type=at_least(0, float), default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM before they are aborted")
    p.add_argument("--otlp-endpoint", default=None, metavar="URL",
                   help="send OpenTelemetry traces (OTLP/HTTP) here, e.g. http://localhost:4318 (default: no tracing)")
    p.add_argument("--request-log", action=argparse.BooleanOptionalAction, default=True,
                   help="one JSON line per finished request on stderr (logger tierlm.requests)")
    from tierlm.dist.cli import add_scale_out_args
    add_scale_out_args(p)
    p.set_defaults(func=run_serve)
    return p


def parse_model_specs(model_dir: str | None, specs: list[str]) -> dict[str, str | None]:
    """NAME → checkpoint dir (None: the demo model; its name comes from the engine)."""
    models: dict[str, str | None] = {}
    if model_dir is not None or not specs:
        models[""] = model_dir  # named after the engine's model_name once loaded
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--model expects NAME=DIR, got '{spec}'")
        if name in models:
            raise ValueError(f"model name '{name}' is given twice; names must be unique")
        models[name] = path
    return models


def parse_lora_modules(specs: list[str]) -> list[tuple[str, str, str | None]]:
    """--lora-modules entries as (adapter name, directory, base model or None: the only one):
    NAME=DIR, or vLLM's JSON object {"name", "path", "base_model_name"}."""
    out: list[tuple[str, str, str | None]] = []
    for spec in specs:
        if spec.lstrip().startswith("{"):
            try:
                obj = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules: {spec!r} is not valid JSON ({e})") from None
            name, path, base = (obj.get(k) if isinstance(obj, dict) else None
                                for k in ("name", "path", "base_model_name"))
            if not (isinstance(name, str) and name and isinstance(path, str) and path) or not (
                    base is None or isinstance(base, str)):
                raise ValueError(f"--lora-modules: {spec!r} needs \"name\" and \"path\" strings (and optionally "
                                 "\"base_model_name\")")
        else:
            name, sep, path = spec.partition("=")
            base = None
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules expects NAME=DIR or a JSON object, got '{spec}'")
        if any(name == n for n, _, _ in out):
            raise ValueError(f"--lora-modules: adapter name '{name}' is given twice; names must be unique")
        out.append((name, path, base))
    return out


def load_lora_modules(engines: dict[str, "AsyncEngine"], modules: list[tuple[str, str, str | None]]) -> None:
    """Load each --lora-modules adapter onto its base model's engine, before serving starts."""
    for name, path, base in modules:
        if base is None:
            if len(engines) != 1:
                raise ValueError(f"--lora-modules: adapter '{name}': {len(engines)} models are served; name its base "
                                 f"as JSON, {{\"name\": \"{name}\", \"path\": \"{path}\", \"base_model_name\": "
                                 f"...}} (one of {', '.join(engines)})")
            base = next(iter(engines))
        if base not in engines:
            raise ValueError(f"--lora-modules: adapter '{name}': base model '{base}' is not served here (served: "
                             f"{', '.join(engines)})")
        if name in engines:
            raise ValueError(f"--lora-modules: adapter '{name}' has the name of a served model; choose another")
        engines[base].engine.add_lora(name, path)


def lora_updates_from_args(args: argparse.Namespace, auth: "Authenticator") -> "LoRAUpdates":
    """Who may call /v1/load_lora_adapter: with API keys, the --lora-admin-key ids (required);
    without keys (loopback or --no-auth), whoever can reach the server."""
    from tierlm.serving.auth import ApiKeyAuth
    from tierlm.serving.lora_admin import LoRAUpdates
    admins = list(getattr(args, "lora_admin_keys", []))
    if not isinstance(auth, ApiKeyAuth):
        if admins:
            raise ValueError("--lora-admin-key names key ids of --api-keys, which this server does not take")
        return LoRAUpdates(None)
    if not admins:
        raise ValueError("--allow-runtime-lora-updating with --api-keys needs --lora-admin-key KEY_ID: loading an "
                         "adapter reads the server's files, and replaces what every tenant's requests for it run")
    unknown = [k for k in admins if k not in set(auth.key_ids)]
    if unknown:
        raise ValueError(f"--lora-admin-key {unknown[0]}: no such key id in {args.api_keys}")
    return LoRAUpdates(frozenset(admins))


def freeze_startup_objects() -> int:
    """Move what start-up allocated (torch, transformers, the models' modules: some 340,000
    objects) out of the garbage collector's sight; returns how many. None of it is garbage, yet
    each full collection walked all of it, stalling the engine loop ~100-200 ms on this machine
    (vLLM's engine freezes its start-up objects for the same reason)."""
    t0 = time.perf_counter()
    gc.collect()  # cyclic garbage from loading is freed first, not frozen for good
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.debug("froze %d start-up objects for the garbage collector in %.2f s", frozen, time.perf_counter() - t0)
    return frozen


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _safety_policies(path: str | None, tenancy: "Tenancy", auth: "Authenticator") -> "SafetyPolicies":
    """--safety-policies read, checked against the tenants file's names, and compiled for every
    tier and tenant (a refused file is a ValueError naming what to mend)."""
    from tierlm.serving.auth import ApiKeyAuth
    from tierlm.serving.safety import SafetyPolicies

    if path is None:
        return SafetyPolicies()
    if not path.strip():  # "$UNSET_VARIABLE"
        raise ValueError("--safety-policies is empty (an unset variable?); give the policies file, or leave it out")
    config = tenancy.config
    key_ids = set(auth.key_ids) if isinstance(auth, ApiKeyAuth) else set()
    # A policy lists tenants: the file's, and keys of their own (a key of a grouped tenant is
    # its tenant's, and a policy naming it would match no request)
    policies = SafetyPolicies.from_file(path, tiers=set(config.tiers) if config else None,
                                        tenants=set(config.tenants) | (key_ids - set(config.key_owner))
                                        if config else None,
                                        key_owner=dict(config.key_owner) if config else None)
    selections = [(None, None)]
    if config is not None:
        selections += [(t.tier, t.id) for t in config.tenants.values()]
        selections += [(config.default_tier, key) for key in key_ids - set(config.key_owner)]
    policies.compile_all(selections)
    logger.info("safety policies from %s: %s", path, ", ".join(
        f"{p.name} ({len(p.phrases)} phrases, {len(p.detectors)} detectors, {p.check}, {p.action})"
        for p in policies.policies))
    return policies


def parse_fallbacks(specs: list[str], served: list[str]) -> dict[str, str]:
    """--fallback-model BIG=SMALL specs → {BIG: SMALL}, both among the `served` names."""
    fallbacks: dict[str, str] = {}
    for spec in specs:
        big, sep, small = spec.partition("=")
        if not sep or not big or not small:
            raise ValueError(f"--fallback-model expects BIG=SMALL (two served model names), got '{spec}'")
        if big in fallbacks:
            raise ValueError(f"--fallback-model: model '{big}' is given two fallbacks; give one")
        for name in (big, small):
            if name not in served:
                raise ValueError(f"--fallback-model {spec}: no model is served as '{name}'; served: "
                                 f"{', '.join(served)} (name models with --model NAME=DIR)")
        fallbacks[big] = small
    return fallbacks


def run_serve(args: argparse.Namespace) -> int:
    if getattr(args, "replicas", 1) > 1:  # copies of this server on Ray, behind a router here
        from tierlm.dist.ray_serve import run_replicated
        return run_replicated(args, getattr(args, "argv", sys.argv[1:]))
    from tierlm.engine.async_engine import AsyncEngine
    from tierlm.errors import TierlmError
    from tierlm.serving.app import build_app
    from tierlm.serving.auth import ApiKeyAuth, Authenticator, NoAuth
    from tierlm.serving.breaker import BreakerSettings
    from tierlm.serving.server import listen_socket, make_server, raise_fd_limit
    from tierlm.serving.sla import SlaGuard
    from tierlm.serving.telemetry import Telemetry, configure_request_log
    from tierlm.serving.batches import BatchJournal, BatchStore
    from tierlm.serving.limit_store import check_apart_from_kv_cache, limit_store_from_args
    from tierlm.serving.tenancy import Tenancy

    raise_fd_limit()  # each connection holds a file descriptor
    sock = None
    try:
        # Built first so a bad --otlp-endpoint fails before minutes of model loading.
        telemetry = Telemetry(otlp_endpoint=getattr(args, "otlp_endpoint", None),
                              log_requests=getattr(args, "request_log", True))
        specs = parse_model_specs(args.model_dir, args.models)
        lora_modules = parse_lora_modules(getattr(args, "lora_modules", []))
        runtime_lora = getattr(args, "allow_runtime_lora_updating", False)
        if lora_modules or runtime_lora:
            args.enable_lora = True
        auth: Authenticator
        if args.api_keys is not None and not args.api_keys.strip():  # as "$UNSET_VARIABLE" gives
            raise ValueError("--api-keys is empty (an unset variable?); give the keys file, or leave it out "
                             "to serve a loopback address without keys")
        if args.api_keys:
            auth = ApiKeyAuth.from_file(args.api_keys)
        elif args.no_auth or _is_loopback(args.host):
            auth = NoAuth()
        else:
            raise ValueError(f"refusing to serve {args.host} without API keys; pass --api-keys FILE "
                             "(or --no-auth if this network is trusted)")
        tenancy = Tenancy()
        if getattr(args, "tenants", None) is not None and not args.tenants.strip():  # "$UNSET_VARIABLE"
            raise ValueError("--tenants is empty (an unset variable?); give the tenants file, or leave it out for "
                             "no tenants (each key its own, no limits)")
        if getattr(args, "tenants", None) is not None:
            if not isinstance(auth, ApiKeyAuth):
                raise ValueError("--tenants needs --api-keys: tenants own the keys of the keys file")
            tenancy = Tenancy.from_file(args.tenants, auth.key_ids)
        check_apart_from_kv_cache(getattr(args, "limits_store", None), getattr(args, "kv_remote", None))
        tenancy.store = limit_store_from_args(getattr(args, "limits_store", None), "server",
                                              tenancy.config is not None)
        safety = _safety_policies(getattr(args, "safety_policies", None), tenancy, auth)
        lora_updates = lora_updates_from_args(args, auth) if runtime_lora else None
        batch_store = BatchStore(journal=BatchJournal(args.batches_dir) if getattr(args, "batches_dir", None) else None,
                                 max_file_bytes=getattr(args, "files_max_bytes", DEFAULT_MAX_FILE_BYTES))
        fallback_specs = getattr(args, "fallback_models", [])
        if "" not in specs:  # every name known: a bad fallback fails before the models load
            parse_fallbacks(fallback_specs, list(specs))
        sock = listen_socket(args.host, args.port)  # a busy port fails now, not after loading
        port = sock.getsockname()[1]
        engines: dict[str, AsyncEngine] = {}
        for name, path in specs.items():
            engine = AsyncEngine.from_model(path, **engine_kwargs(args), **({"served_model_name": name} if name else {}))
            name = name or engine.model_name
            if name in engines:
                raise ValueError(f"two models are named '{name}'; name them with --model NAME=DIR")
            engines[name] = engine
            if path is None:
                from tierlm.models.demo import RANDOM_WEIGHTS_NOTICE
                logger.warning(RANDOM_WEIGHTS_NOTICE)
        load_lora_modules(engines, lora_modules)
        sla = SlaGuard(parse_fallbacks(fallback_specs, list(engines)),
                       breaker=BreakerSettings() if getattr(args, "sla_breaker", True) else None)
    except (TierlmError, ValueError, OSError) as exc:
        if sock is not None:
            sock.close()
        print(f"error: {exc}", file=sys.stderr)
        return 2

    if isinstance(auth, NoAuth):
        logger.warning(NO_AUTH_BANNER.format(where=f"{args.host}:{port}"))
    logger.info("serving %s on http://%s:%d", ", ".join(engines), args.host, port)
    if tenancy.config is not None:
        logger.info("tenants from %s: %s", args.tenants, ", ".join(
            f"{t.id} ({t.tier})" for t in tenancy.config.tenants.values()) or "none (each key its own)")
    if telemetry.log_requests:
        configure_request_log()
    if telemetry.tracer is not None:
        logger.info("sending traces to %s", args.otlp_endpoint)
    app = build_app(engines, auth, max_body_bytes=args.max_body_bytes, telemetry=telemetry,
                    request_read_timeout=args.request_read_timeout, stream_send_timeout=args.stream_send_timeout,
                    tool_call_parser=getattr(args, "tool_call_parser", "auto"),
                    reasoning_parser=getattr(args, "reasoning_parser", "auto"),
                    response_store=ResponseStore(max_bytes=int(getattr(args, "responses_store_mb", 256) * 2**20)),
                    tenancy=tenancy, safety=safety, sla=sla, batch_store=batch_store, lora_updates=lora_updates)
    freeze_startup_objects()
    server = make_server(app, host=args.host, port=port, shutdown_timeout=args.shutdown_timeout,
                         log_level=str(getattr(args, "log_level", "info")).lower())
    server.run(sockets=[sock])  # returns after SIGTERM/SIGINT and a graceful shutdown
    # uvicorn then raises the signal again, for its default action to set the exit status (SIGINT:
    # a KeyboardInterrupt, 130). A signal the process inherited as ignored (SIGINT for a script's
    # background job, `tierlm serve &`) is swallowed there: its status is given here instead.
    captured = getattr(server, "_captured_signals", [])
    return 128 + int(captured[-1]) if captured else 0
