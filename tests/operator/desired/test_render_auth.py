"""spec.engine.apiKeySecretRef and the split roles' shared secret, rendered (pure): the Secret is
mounted whole and read-only (no subPath: rotation needs the kubelet's in-place update) into the
pods that face clients, the engine or the router, and the flag points at the mounted file; every
role pod mounts the roles' secret; no engine or router pod gets a ServiceAccount token."""

from __future__ import annotations

import copy

from split_resource import DEFAULTS, by_name, make_sdd, planned

from specdeploy.operator import api
from specdeploy.operator.desired import render, roles


def aggregated(sdd: dict) -> dict:
    sdd = copy.deepcopy(sdd)
    del sdd["spec"]["disaggregation"]
    return sdd


def with_keys(sdd: dict, **ref) -> dict:
    sdd = copy.deepcopy(sdd)
    sdd["spec"]["engine"]["apiKeySecretRef"] = {"name": "llama-keys", **ref}
    return sdd


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def mounted_file(pod: dict, container: dict, path: str) -> tuple[str, str]:
    """(Secret name, key) that the file `path` of `container` comes from."""
    for mount in container["volumeMounts"]:
        if path.startswith(mount["mountPath"] + "/"):
            assert mount["readOnly"] is True and "subPath" not in mount
            volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
            item = next(i for i in volume["secret"]["items"] if i["path"] == path[len(mount["mountPath"]) + 1:])
            return volume["secret"]["secretName"], item["key"]
    raise AssertionError(f"{path} is not mounted")


def test_the_engine_gets_the_api_keys_file():
    sdd = with_keys(aggregated(make_sdd()))
    children = render.render_children(sdd, planned(sdd), DEFAULTS)
    pod = children.deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    path = flag(container["args"], "--api-key-file")
    assert mounted_file(pod, container, path) == ("llama-keys", "api-keys")
    assert pod["automountServiceAccountToken"] is False
    # Probes stay keyless.
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    other = with_keys(aggregated(make_sdd()), key="clients")
    pod = render.render_children(other, planned(other), DEFAULTS).deployment["spec"]["template"]["spec"]
    assert mounted_file(pod, pod["containers"][0], path) == ("llama-keys", "clients")
    # Naming the Secret rolls the pods; its content (rotation) does not need to.
    plain = aggregated(make_sdd())
    plain_children = render.render_children(plain, planned(plain), DEFAULTS)
    assert plain_children.config_hash != children.config_hash
    assert "--api-key-file" not in plain_children.deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def test_split_roles_share_a_secret_and_the_router_checks_the_keys():
    sdd = with_keys(make_sdd())
    children = roles.render_roles(sdd, planned(sdd), DEFAULTS)
    deployments = by_name(children, "Deployment")
    for role in api.SPLIT_ROLES:
        pod = deployments[roles.role_deployment_name("llama8b", role)]["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert pod["automountServiceAccountToken"] is False
        path = flag(container["args"], "--disagg-secret-file")
        assert mounted_file(pod, container, path) == ("llama8b-disagg", roles.DISAGG_SECRET_KEY)
        keys = flag(container["args"], "--api-key-file")
        if role == "router":
            assert mounted_file(pod, container, keys) == ("llama-keys", "api-keys")
        else:  # only the router is reached by clients
            assert keys is None


def test_the_shared_secret_object_is_owned_by_the_resource():
    sdd = make_sdd()
    secret = roles.disagg_secret_object(sdd, "s3cret-value-of-enough-length")
    assert secret["kind"] == "Secret" and secret["metadata"]["name"] == "llama8b-disagg"
    assert secret["metadata"]["namespace"] == "serving"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "0000-uid"
    assert secret["stringData"] == {roles.DISAGG_SECRET_KEY: "s3cret-value-of-enough-length"}
