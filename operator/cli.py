"""`specdeploy operator`: run the SpecDecodeDeployment operator (kopf underneath).

Peering is off (kopf's standalone mode): run exactly one replica (the chart's Deployment uses the
Recreate strategy). Peering would need kopf's own peering CRDs in every cluster for no gain here:
server-side apply and the status writes' version checks already make a second, briefly overlapping
operator harmless rather than destructive.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import threading
from typing import Any

# The parser is built by `specdeploy` for every subcommand: only the standard library and the
# planner (also stdlib-only) at the top; kopf, httpx and kubernetes inside run().
from specdeploy.engine.planner.remote import DEFAULT_HUB_ENDPOINT

DEFAULT_ENGINE_IMAGE = "ghcr.io/specdeploy/engine:latest"
DEFAULT_LIVENESS_PORT = 8080


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "operator", help="run the SpecDecodeDeployment operator",
        description="Run the SpecDecodeDeployment operator (kopf underneath, peering off: one replica)."
    )
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace", "-n", action="append", dest="namespaces", metavar="NS",
        help="watch this namespace (repeatable); default: all namespaces",
    )
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch all namespaces (the default)")
    parser.add_argument(
        "--liveness-port", type=int, default=DEFAULT_LIVENESS_PORT,
        help="serve GET /healthz on this port (0: off; default %(default)s)",
    )
    parser.add_argument(
        "--engine-image", default=os.environ.get("SPECDEPLOY_ENGINE_IMAGE", DEFAULT_ENGINE_IMAGE),
        help="engine image for resources that name none (env SPECDEPLOY_ENGINE_IMAGE; default %(default)s)",
    )
    parser.add_argument(
        "--hub-endpoint",
        default=os.environ.get("SPECDEPLOY_HUB_ENDPOINT", DEFAULT_HUB_ENDPOINT),
        help="Hugging Face-compatible hub for resources that name none (env SPECDEPLOY_HUB_ENDPOINT; default %(default)s)",
    )
    parser.add_argument(
        "--trusted-hub-endpoint", action="append", dest="trusted_hub_endpoints", metavar="URL",
        default=[e for e in os.environ.get("SPECDEPLOY_TRUSTED_HUB_ENDPOINTS", "").split(",") if e.strip()],
        help="a hub a resource's spec.hub.tokenSecretRef token may be sent to (repeatable; env "
             "SPECDEPLOY_TRUSTED_HUB_ENDPOINTS, comma-separated). Always trusted: the public hub, "
             "--hub-endpoint and HF_ENDPOINT",
    )
    parser.add_argument(
        "--trust-resource-hub-endpoints", action="store_true",
        default=os.environ.get("SPECDEPLOY_TRUST_RESOURCE_HUB_ENDPOINTS", "").lower() == "true",
        help="send tokens to whatever spec.hub.endpoint a resource names (only where everyone who may "
             "create resources may read those Secrets anyway)",
    )
    parser.add_argument(
        "--metrics-interval-s", type=float, default=30.0,
        help="read engine pods' /metrics into status.serving this often (0: never; default %(default)s)",
    )
    parser.add_argument("--verbose", "-v", action="store_true", help="debug logging (kopf's too)")
    parser.set_defaults(func=main)
    return parser


def run(
    *,
    engine_image: str = DEFAULT_ENGINE_IMAGE,
    hub_endpoint: str = DEFAULT_HUB_ENDPOINT,
    namespaces: list[str] | None = None,
    liveness_port: int = 0,
    stop_flag: threading.Event | None = None,
    ready_flag: threading.Event | None = None,
    **option_overrides: Any,
) -> None:
    """Run the operator until `stop_flag` is set (or forever). Tests call this in a thread."""
    import kopf
    from specdeploy.operator.handlers import OperatorOptions, build_registry

    options = OperatorOptions(
        engine_image=engine_image, hub_endpoint=hub_endpoint, namespaces=namespaces, **option_overrides
    )
    asyncio.run(
        kopf.operator(
            registry=build_registry(options),
            standalone=True,
            clusterwide=not namespaces,
            namespaces=namespaces or (),
            liveness_endpoint=f"http://0.0.0.0:{liveness_port}/healthz" if liveness_port else None,
            stop_flag=stop_flag,
            ready_flag=ready_flag,
        )
    )


# kopf's own bookkeeping at INFO: every handler's success, each cause "is processed", start-up
# activities and logins, and a failed handler's reason again after the handler logged it. At the
# default level they are dropped (--verbose shows them): the handlers log what they decided, once.
_KOPF_CHATTER = re.compile(
    r"^(Handler '[^']+' (succeeded|failed (permanently|temporarily)|is invoked)"
    r"|(Creation|Updating|Resuming|Deletion|Resumption) is (processed|in progress)"
    r"|Activity '[^']+' (succeeded|is invoked)"
    r"|Initial authentication has (been initiated|finished))"
)


class _KopfChatterFilter(logging.Filter):
    """Drops kopf's bookkeeping lines (_KOPF_CHATTER); everything else passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name.startswith("kopf") and _KOPF_CHATTER.match(record.getMessage()))


def configure_logging(verbose: bool) -> None:
    import kopf

    # One line per decision for `kubectl logs`: "[namespace/name] message", no colour, no JSON.
    kopf.configure(verbose=verbose, log_format=kopf.LogFormat.PLAIN, log_prefix=True)
    if not verbose:
        # httpx logs every request at INFO; config fetches are reported by the handlers.
        logging.getLogger("httpx").setLevel(logging.WARNING)
        chatter = _KopfChatterFilter()
        for handler in logging.getLogger().handlers:
            handler.addFilter(chatter)


def main(args: argparse.Namespace) -> int:
    configure_logging(args.verbose)
    logging.getLogger("specdeploy").info(
        "starting: %s, engine image %s, hub %s",
        f"namespaces {', '.join(args.namespaces)}" if args.namespaces else "all namespaces",
        args.engine_image, args.hub_endpoint,
    )
    run(
        engine_image=args.engine_image,
        hub_endpoint=args.hub_endpoint,
        namespaces=args.namespaces,
        liveness_port=args.liveness_port,
        metrics_interval_s=args.metrics_interval_s,
        trusted_hub_endpoints=tuple(args.trusted_hub_endpoints)
        + ((os.environ["HF_ENDPOINT"],) if os.environ.get("HF_ENDPOINT") else ()),
        trust_resource_hub_endpoints=args.trust_resource_hub_endpoints,
    )
    return 0
