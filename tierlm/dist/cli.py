"""`tierlm router` and the scale-out options of `tierlm serve` (`--replicas`, `--ray-address`)."""
from __future__ import annotations

import argparse
import logging
from typing import Any

from tierlm.cli import at_least, in_range
from tierlm.dist.affinity import ROUTING_POLICIES
from tierlm.dist.router import DEFAULT_AFFINITY_CHUNKS
from tierlm.serving.validation import DEFAULT_MAX_BODY_BYTES

logger = logging.getLogger("tierlm.router")

_POLICY_HELP = ("cache_aware: the replica where the prompt would be done soonest: the least work in flight "
                "there plus the part of the prompt it does not hold (as far as the router sent it "
                "prompts); least_load: fewest requests in flight; round_robin (default: %(default)s)")


def _routing_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--routing-policy", default="cache_aware", choices=ROUTING_POLICIES, help=_POLICY_HELP)
    p.add_argument("--affinity-chunks", type=at_least(1, int), default=DEFAULT_AFFINITY_CHUNKS,
                   help="prompt chunks (256 bytes) the router remembers per replica, least recently used "
                        "forgotten first: about the replica's KV cache in tokens / 64 (default: %(default)d)")


def add_scale_out_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scale-out (Ray)")
    g.add_argument("--replicas", type=at_least(1, int), default=1,
                   help="run this many copies of the server on a Ray cluster (one GPU each where it has "
                        "enough), with a router here on --host/--port (default: 1, no Ray)")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="the Ray cluster for --replicas, joined from one of its nodes: 'auto' or its head's "
                        "HOST:6379 (the router here must reach the replicas' nodes; default: start a cluster "
                        "on this machine)")
    _routing_args(g)


def add_router_parser(subparsers: Any) -> argparse.ArgumentParser:
    from tierlm.serving.cli import _port

    p = subparsers.add_parser("router", help="one address in front of several servers: routes each request "
                              "to the replica holding its prompt's prefix")
    p.add_argument("--replica", dest="replicas", action="append", default=[], metavar="URL",
                   help="a server to route to, http://HOST:PORT (repeat for each)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8000, help="0 picks a free port (the log says which)")
    _routing_args(p)
    p.add_argument("--api-keys", metavar="FILE", default=None,
                   help="the replicas' keys file: with it the router checks keys itself and routes by "
                        "each key's (or, with --tenants, tenant's) cache salt")
    p.add_argument("--tenants", metavar="FILE", default=None,
                   help="the replicas' tenants file (needs --api-keys): each tenant's requests_per_minute "
                        "and max_concurrent are enforced here across all replicas, not per replica")
    p.add_argument("--limits-store", metavar="URL", default=None,
                   help="a Redis (redis://HOST:PORT/DB) shared by several routers in front of the same "
                        "replicas: the limits --tenants enforces here then hold across all of them (needs "
                        "--tenants)")
    p.add_argument("--health-interval", type=in_range(float, 0, low_open=True), default=2.0,
                   help="seconds between probes of each replica's /ready (default: %(default)g)")
    p.add_argument("--max-body-bytes", type=at_least(1, int), default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get 413 request_too_large")
    p.set_defaults(func=run_router)
    return p


def tenants_of(args: argparse.Namespace, store: bool = True):
    """The router's (auth, tenancy) from --api-keys and --tenants: (None, None) without keys.
    `store`: the router itself shares its limits through --limits-store (`tierlm router`); under
    `serve --replicas` the replicas do, and the router does not open it."""
    from tierlm.serving.auth import ApiKeyAuth
    from tierlm.serving.limit_store import limit_store_from_args
    from tierlm.serving.tenancy import Tenancy

    if getattr(args, "tenants", None) and not getattr(args, "api_keys", None):
        raise ValueError("--tenants needs --api-keys: tenants own the keys of the keys file")
    if not getattr(args, "api_keys", None):
        if getattr(args, "limits_store", None):
            raise ValueError("--limits-store needs --tenants (and --api-keys): the limits it shares are the tenants "
                             "file's")
        return None, None
    auth = ApiKeyAuth.from_file(args.api_keys)
    tenancy = Tenancy.from_file(args.tenants, auth.key_ids) if getattr(args, "tenants", None) else Tenancy()
    if store:
        tenancy.store = limit_store_from_args(getattr(args, "limits_store", None), "router", tenancy.config is not None)
    return auth, tenancy


def run_router(args: argparse.Namespace) -> int:
    import uvicorn

    from tierlm.dist.router import Router, RouterConfig
    from tierlm.serving.server import install_probe_log_filter, listen_socket, raise_fd_limit

    auth, tenancy = tenants_of(args)
    config = RouterConfig(replicas=args.replicas, policy=args.routing_policy,
                          affinity_chunks=args.affinity_chunks, health_interval=args.health_interval,
                          max_body_bytes=args.max_body_bytes, auth=auth, tenancy=tenancy)
    raise_fd_limit()
    install_probe_log_filter()
    sock = listen_socket(args.host, args.port)
    logger.info("routing http://%s:%d to %s (%s)", args.host, sock.getsockname()[1], ", ".join(config.replicas),
                config.policy)
    uvicorn.Server(uvicorn.Config(Router(config), log_level=str(args.log_level).lower(), lifespan="on")).run(
        sockets=[sock])
    return 0
