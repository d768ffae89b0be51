"""The real LeaderWorkerSet controller (sigs.k8s.io/lws, built by hack/build-lws.sh) against the
test cluster: its CRD from the Go module cache, its webhooks served to the API server with a real
certificate (a CA made here, the serving certificate for 127.0.0.1 signed by it, the CA in the
webhook configurations' caBundle), and the controller process itself.

The webhook configurations are LWS's own (config/webhook/manifests.yaml of the module), with two
changes for a cluster without Service routing: the API server calls the webhook by URL
(https://127.0.0.1:PORT/path) instead of through a Service, and the pod webhooks see only pods of
a LeaderWorkerSet (objectSelector), so that a stopped controller never blocks other pods of a
cluster the test session shares. Both configurations are deleted again by stop()."""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import os
import socket
import subprocess
import time
from pathlib import Path

import httpx
import yaml

import lws_module

REPO = Path(__file__).resolve().parents[2]
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
WEBHOOK_CONFIGS = {"MutatingWebhookConfiguration": "specdeploy-test-lws-mutating",
                   "ValidatingWebhookConfiguration": "specdeploy-test-lws-validating"}


def controller_binary() -> Path:
    path = Path(subprocess.run([str(REPO / "hack" / "build-lws.sh"), "--print-path"], capture_output=True,
                               text=True, check=True).stdout.strip())
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"the LeaderWorkerSet controller is not built ({path} missing): run hack/build-lws.sh")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _certificates(directory: Path) -> bytes:
    """A CA and a serving certificate for 127.0.0.1 signed by it (tls.crt, tls.key in
    `directory`, as controller-runtime's webhook server reads them); -> the CA in PEM."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "specdeploy test LWS webhook CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / "tls.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                           serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    return ca.public_bytes(serialization.Encoding.PEM)


def webhook_configurations(port: int, ca_pem: bytes) -> list[dict]:
    """LWS's webhook configurations, called by URL on 127.0.0.1:port and trusting `ca_pem`."""
    docs = [d for d in yaml.safe_load_all((lws_module.module_dir() / "config/webhook/manifests.yaml").read_text()) if d]
    for doc in docs:
        doc["metadata"] = {"name": WEBHOOK_CONFIGS[doc["kind"]]}
        for hook in doc["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}",
                                    "caBundle": base64.b64encode(ca_pem).decode()}
            if any("pods" in rule["resources"] for rule in hook["rules"]):
                hook["objectSelector"] = {"matchExpressions": [{"key": LWS_NAME_LABEL, "operator": "Exists"}]}
    return docs


class LwsController:
    def __init__(self, cluster, workdir: Path) -> None:
        self.cluster, self.workdir = cluster, workdir
        self.proc: subprocess.Popen | None = None
        self.log_path = workdir / "lws-controller.log"

    def start(self, timeout_s: float = 120) -> LwsController:
        binary = controller_binary()
        lws_module.install_crd(self.cluster)
        self.cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f",
                             str(lws_module.module_dir() / lws_module.DISAGGREGATED_SET_CRD_FILE))
        port, health = free_port(), free_port()
        ca = _certificates(self.workdir / "certs")
        config = {
            "apiVersion": "config.lws.x-k8s.io/v1alpha1", "kind": "Configuration",
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "webhook": {"port": port, "host": "127.0.0.1", "certDir": str(self.workdir / "certs")},
            "metrics": {"bindAddress": "0"},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{health}"},
        }
        (self.workdir / "config.yaml").write_text(yaml.safe_dump(config))
        self.log = self.log_path.open("wb")
        self.proc = subprocess.Popen([str(binary), f"--config={self.workdir / 'config.yaml'}"],
                                     env={**self.cluster.env, "KUBECONFIG": str(self.cluster.kubeconfig)},
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, "the LWS controller exited:\n" + self.logs()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{health}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the LWS controller was not ready:\n" + self.logs()[-3000:]
            time.sleep(0.5)
        for doc in webhook_configurations(port, ca):
            self.cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=json.dumps(doc))
        return self

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        for kind, name in WEBHOOK_CONFIGS.items():
            self.cluster.kubectl("delete", kind.lower(), name, "--ignore-not-found", check=False)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.log.close()
        lws_module.uninstall_crd(self.cluster)
        self.cluster.kubectl("delete", "crd", lws_module.DISAGGREGATED_SET_CRD_NAME, "--ignore-not-found", check=False)


class ClusterHosts:
    """The hosts file cluster_dns/sitecustomize.py reads: `<hostname>.<subdomain>.<namespace>` of
    every pod with an IP in `namespace`, refreshed by poll()."""

    def __init__(self, cluster, namespace: str, path: Path) -> None:
        self.cluster, self.namespace, self.path = cluster, namespace, path
        self._write({})

    def _write(self, hosts: dict) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**hosts, "_namespaces": [self.namespace]}))
        tmp.replace(self.path)

    def poll(self) -> dict:
        pods = self.cluster.kubectl_json("get", "pods", "-n", self.namespace)["items"]
        hosts = {}
        for pod in pods:
            ip, spec = pod["status"].get("podIP"), pod["spec"]
            if ip and spec.get("subdomain") and not pod["metadata"].get("deletionTimestamp"):
                base = f"{spec.get('hostname') or pod['metadata']['name']}.{spec['subdomain']}.{self.namespace}"
                for name in (base, f"{base}.svc", f"{base}.svc.cluster.local"):
                    hosts[name] = ip
        self._write(hosts)
        return hosts
