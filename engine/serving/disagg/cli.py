"""`specdeploy router`: the command line of the disaggregated deployment's OpenAI front
(router.py). Stdlib only at the top: building the parser must not import the engine's packages."""

from __future__ import annotations

import argparse
import logging
import urllib.parse

log = logging.getLogger("specdeploy.router")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "router", help="OpenAI front of prefill and decode servers",
        description="Send each request's prefill to a prefill server and its decode to a decode "
                    "server (engine serve --role prefill / decode), picked by load.")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="prefill servers (a headless Service URL stands for all its pods)")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode servers")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--refresh-s", type=float, default=1.0, help="seconds between backend status reads")
    p.add_argument("--timeout-s", type=float, default=600.0, help="longest a request may take")
    p.add_argument("--api-key-file", metavar="PATH",
                   help="clients must send `Authorization: Bearer KEY`, KEY one of this file's lines (read "
                        "again when it changes); /health, /ready and /metrics stay open")
    p.add_argument("--disagg-secret-file", metavar="PATH",
                   help="the secret the prefill and decode servers were given (--disagg-secret-file there)")
    p.set_defaults(func=run)
    return p


def check_args(args: argparse.Namespace) -> None:
    for url in [*args.prefill, *args.decode]:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url}: not an http(s) URL")
    if args.refresh_s <= 0 or args.timeout_s <= 0:
        raise ValueError("--refresh-s and --timeout-s must be > 0")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from specdeploy.engine.serving.auth import guard_from_files
    from specdeploy.engine.serving.boot import configure_logging
    from specdeploy.engine.serving.disagg.router import create_app

    configure_logging()
    try:
        check_args(args)
        guard = guard_from_files(args.api_key_file, args.disagg_secret_file)
    except ValueError as e:
        log.error("%s", e)
        return 2
    app = create_app(args.prefill, args.decode, refresh_s=args.refresh_s, timeout_s=args.timeout_s, guard=guard)
    log.info("router: prefill %s, decode %s", " ".join(args.prefill), " ".join(args.decode))
    from specdeploy.engine.serving.boot import KEEP_ALIVE_TIMEOUT_S
    from specdeploy.engine.serving.limits import DEFAULT_HEADER_TIMEOUT_S, bounded_h11_protocol

    uvicorn.run(app, host=args.host, port=args.port, log_config=None, timeout_keep_alive=KEEP_ALIVE_TIMEOUT_S,
                http=bounded_h11_protocol(DEFAULT_HEADER_TIMEOUT_S))
    return 0
