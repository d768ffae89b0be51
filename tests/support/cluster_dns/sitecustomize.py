"""Cluster DNS for pods that the test cluster's local kubelet runs as processes of this machine.

The test cluster has no DNS server, and its pods' processes share this machine's resolver. A
LeaderWorkerSet's pods find their leader by the name `<leader pod>.<lws>.<namespace>` (its
headless Service), so a pod whose PYTHONPATH holds this directory resolves names from the JSON
file SPECDEPLOY_TEST_HOSTS names ({name: pod IP}), which the test keeps current from the pods'
hostname, subdomain and IP, as the cluster's DNS would. Every other name resolves as usual; a
name of the form `*.<namespace>` that the file does not hold fails as an unknown name does.
"""

import json
import os
import socket

_HOSTS = os.environ.get("SPECDEPLOY_TEST_HOSTS")

if _HOSTS:
    _getaddrinfo = socket.getaddrinfo

    def _cluster_getaddrinfo(host, *args, **kwargs):
        name = host.decode() if isinstance(host, bytes) else host
        try:
            with open(_HOSTS) as f:
                hosts = json.load(f)
        except (OSError, ValueError):
            hosts = {}
        if name in hosts:
            return _getaddrinfo(hosts[name], *args, **kwargs)
        suffixes = tuple(f".{ns}" for ns in hosts.get("_namespaces", []))
        if name and suffixes and name.endswith(suffixes):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return _getaddrinfo(host, *args, **kwargs)

    socket.getaddrinfo = _cluster_getaddrinfo
