"""Where a model's config.json comes from: inline, a ConfigMap, or a Hugging Face-compatible hub;
and, for a model on the hub, its checkpoint's real weight bytes.

The functions here do no Kubernetes I/O themselves: ConfigMap and Secret contents come through a
`ClusterReader`, so the resolution rules are testable with plain dicts, and the hub is reached over
HTTP with httpx (tests run a real local HTTP server as the hub).

Weights (`resolve_model_weights`): a hub model's `model.safetensors.index.json` and each shard's
safetensors header, read with HTTP range requests (a few hundred kilobytes per shard, never the
weights), counted by the planner's pure header reader (engine/planner/weights.py, the same one
`specdeploy plan ORG/NAME` uses over urllib). A config given inline or in a ConfigMap means the
operator is not to reach the hub for that model: its weights are then estimated by the plan
(from quantization_config, else the parameter count).

Every failure is a `ConfigSourceError` with a condition reason, a message that names the field or
URL, and whether retrying can help without the user editing the resource (`transient`).

A hub is untrusted input (the endpoint may be the resource's choice): each read has a total
deadline as well as a per-read timeout (a drip of one byte every few seconds would never trip the
latter), HUB_CONFIG_DEADLINE_S for config.json and HUB_DEADLINE_S for all of a model's weight
headers; a JSON answer is capped at MAX_HUB_JSON_BYTES, a header and the shard count by the
planner's weights limits. URLs, timeouts and deadlines are the hub client's
(engine/planner/hub_client.py), the one the planner and the engine read through. A token goes only to an endpoint the operator trusts
(`check_token_endpoint`; docs/operator.md).
"""

from __future__ import annotations

import json
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from specdeploy.engine.planner.errors import ConfigError
from specdeploy.engine.planner.hub_client import (
    DEFAULT_HUB_ENDPOINT,
    HUB_CONFIG_DEADLINE_S,
    HUB_DEADLINE_S,
    MAX_HUB_JSON_BYTES,
    Deadline,
    auth_headers,
    hub_file_url,
    httpx_client,
    read_capped,
    revision_problem,
)
from specdeploy.engine.planner.weights import SINGLE_FILE, CheckpointWeights, read_checkpoint_weights
from specdeploy.operator import api
from specdeploy.operator.desired.render import api_key_secret

DEFAULT_REVISION = "main"
DEFAULT_CONFIG_KEY = "config.json"
DEFAULT_TOKEN_KEY = "token"



class ConfigSourceError(Exception):
    """A model config that cannot be obtained; `reason` becomes the condition reason."""

    def __init__(self, reason: str, message: str, *, transient: bool) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.transient = transient


class ClusterReader(Protocol):
    """Reads the namespaced objects a spec may refer to; None when the object does not exist."""

    def config_map_data(self, namespace: str, name: str) -> dict[str, str] | None: ...

    def secret_data(self, namespace: str, name: str) -> dict[str, str] | None:
        """Decoded (not base64) Secret values."""
        ...


@dataclass(frozen=True)
class ResolvedConfig:
    """A model's config.json and where it was read from (for messages and events)."""

    config: dict[str, Any]
    origin: str


def _origin(url: str) -> tuple[str, str, int | None, str]:
    parts = urllib.parse.urlsplit(url.strip())
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower(), parts.port or {"https": 443, "http": 80}.get(scheme), \
        parts.path.rstrip("/")


def trusted_endpoints(operator_endpoint: str, extra: tuple[str, ...] | list[str] = ()) -> tuple[str, ...]:
    """The endpoints a hub token may be sent to: the public hub, the operator's own default
    endpoint (--hub-endpoint) and those its flags list (--trusted-hub-endpoint, HF_ENDPOINT)."""
    return tuple(dict.fromkeys([DEFAULT_HUB_ENDPOINT, operator_endpoint, *extra]))


def check_token_endpoint(endpoint: str, trusted: tuple[str, ...], *, allow_any: bool) -> None:
    """A token Secret is named: refuse (permanently: the spec or the operator's flags must change)
    unless `endpoint`, where the operator and the engine pod would send it, is trusted."""
    if allow_any or any(_origin(endpoint) == _origin(t) for t in trusted):
        return
    raise ConfigSourceError(
        api.REASON_HUB_NOT_TRUSTED,
        f"spec.hub.endpoint {endpoint} is not an endpoint this operator sends tokens to "
        f"(trusted: {', '.join(trusted)}); drop spec.hub.tokenSecretRef, use a trusted endpoint, "
        "or start the operator with --trusted-hub-endpoint",
        transient=False,
    )


def _revision(model_spec: dict[str, Any], field: str) -> str:
    revision = model_spec.get("revision", DEFAULT_REVISION)
    problem = revision_problem(revision)
    if problem is not None:
        raise ConfigSourceError(api.REASON_CONFIG_INVALID, f"{field}.{problem}", transient=False)
    return revision


def _hub_failure(url: str, exc: httpx.HTTPError, deadline: Deadline | None) -> ConfigSourceError:
    if deadline is not None and deadline.expired:
        return ConfigSourceError(api.REASON_HUB_UNREACHABLE,
                                 f"GET {url}: no whole answer within the {deadline.seconds:.0f} s deadline",
                                 transient=True)
    return ConfigSourceError(api.REASON_HUB_UNREACHABLE, f"GET {url}: {type(exc).__name__}: {exc}", transient=True)


def _read_json_body(response: httpx.Response, url: str) -> bytes:
    """The body of a JSON answer, refused past MAX_HUB_JSON_BYTES (declared or sent)."""
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_HUB_JSON_BYTES:
        raise ConfigSourceError(api.REASON_HUB_ANSWER_TOO_LARGE,
                                f"GET {url}: {declared} bytes, larger than {MAX_HUB_JSON_BYTES}; refused",
                                transient=False)
    chunks = response.iter_bytes()
    try:
        return read_capped(lambda _n: next(chunks, b""), MAX_HUB_JSON_BYTES, f"GET {url}")
    except ConfigError as err:
        raise ConfigSourceError(api.REASON_HUB_ANSWER_TOO_LARGE, str(err), transient=False) from None


def resolve_hub_token(
    hub_spec: dict[str, Any] | None, namespace: str, reader: ClusterReader
) -> str | None:
    ref = (hub_spec or {}).get("tokenSecretRef")
    if not ref:
        return None
    name, key = ref["name"], ref.get("key", DEFAULT_TOKEN_KEY)
    field = "spec.hub.tokenSecretRef"
    data = reader.secret_data(namespace, name)
    if data is None:
        raise ConfigSourceError(
            api.REASON_TOKEN_NOT_FOUND, f"{field}: Secret {namespace}/{name} not found", transient=True
        )
    token = data.get(key)
    if not token:
        raise ConfigSourceError(
            api.REASON_TOKEN_NOT_FOUND,
            f"{field}: Secret {namespace}/{name} has no key {key!r}",
            transient=True,
        )
    return token.strip()


def check_api_key_secret(spec: dict[str, Any], namespace: str, reader: ClusterReader) -> None:
    """spec.engine.apiKeySecretRef must name a Secret that exists and holds at least one key:
    the pod would otherwise wait for the volume, or the engine refuse to start. Transient: the
    Secret may be created or fixed at any time."""
    ref = api_key_secret(spec)
    if ref is None:
        return
    name, key = ref
    field = "spec.engine.apiKeySecretRef"
    data = reader.secret_data(namespace, name)
    if data is None:
        raise ConfigSourceError(api.REASON_API_KEY_SECRET_NOT_FOUND,
                                f"{field}: Secret {namespace}/{name} not found", transient=True)
    lines = [line.strip() for line in (data.get(key) or "").splitlines()]
    if not any(line and not line.startswith("#") for line in lines):
        raise ConfigSourceError(api.REASON_API_KEY_SECRET_NOT_FOUND,
                                f"{field}: Secret {namespace}/{name} has no key {key!r} holding an API key "
                                "(one per line)", transient=True)


def resolve_model_config(
    model_spec: dict[str, Any],
    field: str,
    namespace: str,
    reader: ClusterReader,
    *,
    hub_endpoint: str,
    hub_token: str | None,
    http: httpx.Client | None = None,
    deadline_s: float = HUB_CONFIG_DEADLINE_S,
) -> ResolvedConfig:
    """The config.json of `model_spec` (spec.target or spec.draft, named by `field`)."""
    if "config" in model_spec:
        config = model_spec["config"]
        if not isinstance(config, dict) or not config:
            raise ConfigSourceError(
                api.REASON_CONFIG_INVALID, f"{field}.config: must be a non-empty object", transient=False
            )
        return ResolvedConfig(config, f"{field}.config")
    if "configMapRef" in model_spec:
        return _from_config_map(model_spec["configMapRef"], field, namespace, reader)
    return _from_hub(
        model_spec["model"],
        _revision(model_spec, field),
        hub_endpoint,
        hub_token,
        http,
        deadline_s,
    )


def _from_config_map(
    ref: dict[str, Any], field: str, namespace: str, reader: ClusterReader
) -> ResolvedConfig:
    name, key = ref["name"], ref.get("key", DEFAULT_CONFIG_KEY)
    origin = f"ConfigMap {namespace}/{name} key {key}"
    data = reader.config_map_data(namespace, name)
    # A ConfigMap may be created or fixed after the resource: retry rather than give up.
    if data is None:
        raise ConfigSourceError(
            api.REASON_CONFIG_NOT_FOUND,
            f"{field}.configMapRef: ConfigMap {namespace}/{name} not found",
            transient=True,
        )
    if key not in data:
        raise ConfigSourceError(
            api.REASON_CONFIG_NOT_FOUND,
            f"{field}.configMapRef: ConfigMap {namespace}/{name} has no key {key!r}",
            transient=True,
        )
    return ResolvedConfig(_parse_json_object(data[key], origin, transient=True), origin)


def _from_hub(
    model: str,
    revision: str,
    endpoint: str,
    token: str | None,
    http: httpx.Client | None,
    deadline_s: float = HUB_CONFIG_DEADLINE_S,
) -> ResolvedConfig:
    url = hub_file_url(endpoint, model, revision, "config.json")
    deadline = Deadline(deadline_s)
    client = http or httpx_client(httpx.Client, deadline)
    try:
        with client.stream("GET", url, headers=auth_headers(token)) as response:
            body = _read_json_body(response, url) if response.status_code == 200 else b""
    except httpx.HTTPError as exc:
        raise _hub_failure(url, exc, deadline) from exc
    finally:
        if http is None:
            client.close()
    status = response.status_code
    if status == 404:
        raise ConfigSourceError(
            api.REASON_CONFIG_NOT_FOUND,
            f"GET {url}: 404 (no such model {model!r} or revision {revision!r})",
            transient=False,
        )
    if status in (401, 403):
        # Gated or private models; the token lives in a Secret that may be fixed at any time.
        raise ConfigSourceError(
            api.REASON_HUB_UNAUTHORIZED,
            f"GET {url}: {status} ({'token rejected' if token else 'no token given'};"
            " set spec.hub.tokenSecretRef to a token with access)",
            transient=True,
        )
    if status >= 500 or status == 429:
        raise ConfigSourceError(
            api.REASON_HUB_UNREACHABLE, f"GET {url}: {status} from hub", transient=True
        )
    if status != 200:
        raise ConfigSourceError(
            api.REASON_CONFIG_NOT_FOUND, f"GET {url}: unexpected status {status}", transient=False
        )
    return ResolvedConfig(_parse_json_object(body.decode("utf-8", errors="replace"), url, transient=False), url)


def _parse_json_object(text: str, origin: str, *, transient: bool) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigSourceError(
            api.REASON_CONFIG_INVALID, f"{origin}: not JSON ({exc})", transient=transient
        ) from exc
    if not isinstance(value, dict):
        raise ConfigSourceError(
            api.REASON_CONFIG_INVALID,
            f"{origin}: expected a JSON object, got {type(value).__name__}",
            transient=transient,
        )
    return value


# --------------------------------------------------------------------------------------------
# checkpoint weights from the hub


class HubCheckpointFiles:
    """The planner's CheckpointFiles over a hub repository, with httpx: JSON files whole, shard
    headers by Range (a server that ignores Range is read only as far as needed)."""

    def __init__(self, model: str, revision: str, endpoint: str, token: str | None, http: httpx.Client,
                 deadline: Deadline | None = None):
        self.model, self.revision, self.endpoint, self.http = model, revision, endpoint, http
        self.deadline = deadline
        self.headers = auth_headers(token)
        self.token_given = bool(token)
        self.origin = f"{endpoint.rstrip('/')}/{model}/resolve/{revision}"

    def _check(self, url: str, status: int) -> bool:
        """False for 404 (no such file); raises for what makes the bytes unknowable now."""
        if status == 404:
            return False
        if status in (401, 403):
            raise ConfigSourceError(
                api.REASON_HUB_UNAUTHORIZED,
                f"GET {url}: {status} ({'token rejected' if self.token_given else 'no token given'};"
                " set spec.hub.tokenSecretRef to a token with access)", transient=True)
        if status >= 500 or status == 429:
            raise ConfigSourceError(api.REASON_HUB_UNREACHABLE, f"GET {url}: {status} from hub", transient=True)
        if status not in (200, 206, 416):
            raise ConfigSourceError(api.REASON_CONFIG_INVALID, f"GET {url}: unexpected status {status}",
                                    transient=False)
        return True

    def read_json(self, name: str) -> Any | None:
        url = hub_file_url(self.endpoint, self.model, self.revision, name)
        try:
            with self.http.stream("GET", url, headers=self.headers) as response:
                if not self._check(url, response.status_code):
                    return None
                body = _read_json_body(response, url)
        except httpx.HTTPError as exc:
            raise _hub_failure(url, exc, self.deadline) from exc
        try:
            return json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigSourceError(api.REASON_CONFIG_INVALID, f"{url}: not JSON ({exc})", transient=False) from exc

    def read_range(self, name: str, start: int, length: int) -> bytes | None:
        url = hub_file_url(self.endpoint, self.model, self.revision, name)
        headers = {**self.headers, "Range": f"bytes={start}-{start + length - 1}"}
        try:
            with self.http.stream("GET", url, headers=headers) as response:
                if not self._check(url, response.status_code):
                    return None
                if response.status_code == 416:
                    return b""
                wanted = length if response.status_code == 206 else start + length
                body = b""
                for chunk in response.iter_bytes():
                    body += chunk
                    if len(body) >= wanted:
                        break
                return body[:wanted] if response.status_code == 206 else body[start:wanted]
        except httpx.HTTPError as exc:
            raise _hub_failure(url, exc, self.deadline) from exc

    def safetensors_names(self) -> list[str]:
        return [SINGLE_FILE]


# Checkpoint bytes read from the hub, kept for a while: a resource retried every few seconds
# (a conflict, a rollout) must not re-read a 4 MB index and a dozen headers each time. A moving
# revision (main) is re-read after WEIGHTS_CACHE_TTL_S.
WEIGHTS_CACHE_TTL_S = 600.0
WEIGHTS_CACHE_ENTRIES = 64
_weights_cache: dict[tuple[str, str, str, bool], tuple[float, CheckpointWeights | None]] = {}


def resolve_model_weights(
    model_spec: dict[str, Any],
    field: str,
    *,
    hub_endpoint: str,
    hub_token: str | None,
    http: httpx.Client | None = None,
    now: Callable[[], float] = time.monotonic,
    deadline_s: float = HUB_DEADLINE_S,
) -> CheckpointWeights | None:
    """The checkpoint bytes of a model whose config comes from the hub (None for an inline or
    ConfigMap config, or a repository without safetensors), all read within `deadline_s`."""
    if "config" in model_spec or "configMapRef" in model_spec:
        return None
    revision = _revision(model_spec, field)
    key = (hub_endpoint, model_spec["model"], revision, bool(hub_token))
    cached = _weights_cache.get(key)
    if cached is not None and now() - cached[0] < WEIGHTS_CACHE_TTL_S:
        return cached[1]
    deadline = Deadline(deadline_s)
    client = http or httpx_client(httpx.Client, deadline)
    try:
        weights = read_checkpoint_weights(HubCheckpointFiles(model_spec["model"], revision, hub_endpoint, hub_token,
                                                             client, deadline))
    except ConfigError as err:
        raise ConfigSourceError(api.REASON_CONFIG_INVALID, f"{field}: checkpoint: {err}", transient=False) from err
    finally:
        if http is None:
            client.close()
    if len(_weights_cache) >= WEIGHTS_CACHE_ENTRIES:
        _weights_cache.pop(next(iter(_weights_cache)))
    _weights_cache[key] = (now(), weights)
    return weights


def resolve_configs(
    sdd: dict[str, Any], reader: ClusterReader, hub_endpoint: str, *,
    trusted_endpoints: tuple[str, ...] | None = None, trust_any_endpoint: bool = False,
) -> tuple[ResolvedConfig, ResolvedConfig | None, tuple[CheckpointWeights | None, CheckpointWeights | None]]:
    """Both models' config.json and, where they come from the hub, their checkpoints' weight
    bytes: what the operator reads for a resource (handlers.resolve_configs) and what
    `specdeploy plan -f` reads for a file (operator/plan_file.py), the same way.
    `trusted_endpoints` (the operator's): a named token Secret goes only to those (check_token_endpoint)."""
    spec, namespace = sdd["spec"], sdd["metadata"].get("namespace") or "default"
    hub_spec = spec.get("hub") or {}
    endpoint = hub_spec.get("endpoint") or hub_endpoint
    if hub_spec.get("tokenSecretRef") and trusted_endpoints is not None:
        # The engine pod gets the token too, whether the operator reads the hub or not.
        check_token_endpoint(endpoint, trusted_endpoints, allow_any=trust_any_endpoint)
    needs_hub = any(
        m and "config" not in m and "configMapRef" not in m for m in (spec["target"], spec.get("draft"))
    )
    token = resolve_hub_token(hub_spec, namespace, reader) if needs_hub else None
    target = resolve_model_config(spec["target"], "spec.target", namespace, reader, hub_endpoint=endpoint,
                                  hub_token=token)
    draft = None
    if spec.get("draft"):
        draft = resolve_model_config(spec["draft"], "spec.draft", namespace, reader, hub_endpoint=endpoint,
                                     hub_token=token)
    weights = (
        resolve_model_weights(spec["target"], "spec.target", hub_endpoint=endpoint, hub_token=token),
        resolve_model_weights(spec["draft"], "spec.draft", hub_endpoint=endpoint, hub_token=token)
        if spec.get("draft") else None,
    )
    return target, draft, weights
