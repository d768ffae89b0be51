"""What `engine serve` checks before it serves, and how a failed start is reported.

Two moments:
  preflight   before the HTTP server starts (milliseconds to a few hub round trips): each model
              is a directory with a config.json, or a hub id whose config.json the hub answers
              (or the local HF cache holds), and the pair passes the planner's compatibility
              check (engine/planner/compat.py), so a mismatched pair never downloads a weight.
  load        after it started (engine/serving/cli.py load_engine): a failure is one line naming
              the cause, with exit code 2 for what the user can fix (a path, the hub, the pair,
              an architecture the engine does not serve, a plan this GPU cannot hold) and 1 for
              faults (anything else: a bug, a broken device). The traceback is logged only at
              --log-level debug.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("specdeploy.engine")

USER_ERROR = 2
FAULT = 1


class StartupError(ValueError):
    """A start the user can fix; the message is the one line."""


def _local_config(name: str, flag: str) -> dict[str, Any] | None:
    """config.json of a local model directory; None when `name` is no local path (a hub id)."""
    path = Path(name)
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise StartupError(f"{flag} {name}: the directory has no config.json")
        try:
            return json.loads(config.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise StartupError(f"{flag} {name}/config.json: not readable JSON ({err})") from None
    if path.exists():
        raise StartupError(f"{flag} {name}: not a directory (give the model's directory, which holds config.json)")
    if path.is_absolute() or name.startswith(".") or name.count("/") != 1:
        raise StartupError(f"{flag} {name}: no such directory, and not a hub id ORG/NAME")
    return None


def _hub_config(name: str, revision: str, flag: str) -> dict[str, Any]:
    from specdeploy.engine.planner.errors import ConfigError
    from specdeploy.engine.planner.remote import HubFiles
    from specdeploy.engine.serving import hub

    snapshot = hub.cached_snapshot(name, revision)
    if snapshot is not None:
        return json.loads((snapshot / "config.json").read_text())
    files = HubFiles(name, revision)
    try:
        config = files.read_json("config.json")
    except ConfigError as err:
        raise StartupError(f"{flag} {name}: {err}") from None
    if config is None:
        raise StartupError(f"{flag} {name}: {files.origin}/config.json: 404 (no such model or revision {revision!r})")
    if not isinstance(config, dict):
        raise StartupError(f"{flag} {name}: {files.origin}/config.json: expected a JSON object")
    return config


def model_config(name: str, revision: str, flag: str) -> dict[str, Any]:
    local = _local_config(name, flag)
    return local if local is not None else _hub_config(name, revision, flag)


def plan_algorithm(plan_path: str | None) -> str | None:
    if not plan_path:
        return None
    try:
        return json.loads(Path(plan_path).read_text()).get("algorithm")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as err:
        raise StartupError(f"--plan {plan_path}: not a readable plan.json ({err})") from None


def check_pair(algorithm: str, target_config: dict[str, Any], draft_config: dict[str, Any] | None) -> None:
    """The planner's pair check (the same line `specdeploy plan` and the operator give)."""
    from specdeploy.engine.planner.plan import PlanError, check_pair as planner_check_pair

    try:
        planner_check_pair(algorithm, target_config, draft_config)
    except PlanError as err:
        raise StartupError(f"{err.reason}: {err}") from None


def preflight(args) -> None:
    """Refuses (StartupError) a start that can only fail, before the server listens."""
    algorithm = args.algorithm or plan_algorithm(args.plan) or "NONE"
    target = model_config(args.target, args.target_revision, "--target")
    draft = model_config(args.draft, args.draft_revision, "--draft") if args.draft else None
    check_pair(algorithm, target, draft)


def failure_line(err: BaseException) -> tuple[int, str]:
    """(exit code, one line) for an exception that ended loading."""
    import httpx

    from specdeploy.engine.serving.hub import HubError

    if isinstance(err, StartupError):
        return USER_ERROR, str(err)
    if isinstance(err, httpx.TransportError):
        url = err.request.url if _has_request(err) else "the hub"
        return USER_ERROR, f"cannot reach the hub at {url}: {type(err).__name__}: {err or 'no answer'}"
    if isinstance(err, httpx.HTTPStatusError):
        return USER_ERROR, f"the hub answered {err.response.status_code} for {err.request.url}"
    if isinstance(err, HubError):
        return USER_ERROR, f"hub: {err}"
    if _is_out_of_memory(err):
        return USER_ERROR, (f"out of memory while loading ({str(err).splitlines()[0] if str(err) else type(err).__name__}): "
                            "the plan does not fit this device; give a plan made for it, or lower "
                            "--context-length / --max-running-requests / --max-total-tokens")
    if isinstance(err, (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)):
        return USER_ERROR, f"{err}"
    if isinstance(err, ValueError):  # ConfigError, PlanError, unsupported architectures, bad arguments
        reason = getattr(err, "reason", None)
        return USER_ERROR, f"{reason}: {err}" if reason else str(err)
    return FAULT, f"loading failed: {type(err).__name__}: {err} (--log-level debug logs the traceback)"


def _has_request(err) -> bool:
    try:
        err.request  # noqa: B018 - raises RuntimeError when the error carries none
    except RuntimeError:
        return False
    return True


def _is_out_of_memory(err: BaseException) -> bool:
    if isinstance(err, MemoryError):
        return True
    try:
        import torch
    except ImportError:
        return False
    return isinstance(err, torch.OutOfMemoryError)


def report(err: BaseException, context: str = "engine serve") -> int:
    """Log a failed start as one line (the traceback too at debug level); -> the exit code."""
    code, line = failure_line(err)
    debug = log.isEnabledFor(logging.DEBUG)
    log.error("%s: %s", context, " ".join(line.split()), exc_info=err if debug else None)
    return code
