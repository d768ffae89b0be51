"""Certificates for a local node's kubelet API, issued by the cluster's own CA, and the
apiserver's front proxy (the aggregation layer's client certificate and its CA).

The apiserver dials a kubelet over TLS and, with `--kubelet-certificate-authority`, verifies the
serving certificate against that CA with the node's InternalIP as the name: so the node gets a
certificate from kwokctl's CA (pki/ca.crt, ca.key) whose subjectAltName is its address. The other
direction, the apiserver's client certificate (`--kubelet-client-certificate`), is checked by the
kubelet API against the same CA and by fingerprint (`fingerprint_of`).

The aggregation layer (`write_front_proxy`): the apiserver proxies a request for an APIService
(custom.metrics.k8s.io, served by prometheus-adapter) with a client certificate of its own and
the user in `X-Remote-*` headers; the extension server believes those headers only from a
certificate signed by the CA of `--requestheader-client-ca-file` whose name is one of
`--requestheader-allowed-names`. A CA of its own, as kubeadm's front-proxy-ca, so no other
certificate of the cluster can assert a user that way.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import ssl
import warnings
from pathlib import Path

CERT_VALIDITY_DAYS = 365
FRONT_PROXY_CLIENT = "front-proxy-client"


def issue_serving_cert(ca_cert_pem: bytes, ca_key_pem: bytes, common_name: str, ips: list[str],
                       dns_names: list[str] = ()) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) for a TLS server at `ips`/`dns_names`, signed by the CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    with warnings.catch_warnings():
        # kwokctl's CA carries a serial number cryptography warns about; it signs as well as any.
        warnings.simplefilter("ignore")
        ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    names = [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips] + [x509.DNSName(d) for d in dns_names]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CERT_VALIDITY_DAYS))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def _new_cert(subject: str, issuer: str, public_key, signing_key, *, ca: bool, usage=None) -> bytes:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CERT_VALIDITY_DAYS))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
            key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False),
            critical=True)
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    return builder.sign(signing_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def front_proxy_paths(out_dir: Path) -> tuple[Path, Path, Path]:
    """(CA certificate, client certificate, client key) of the front proxy under `out_dir`."""
    return out_dir / "front-proxy-ca.crt", out_dir / "front-proxy-client.crt", out_dir / "front-proxy-client.key"


def write_front_proxy(out_dir: Path) -> tuple[Path, Path, Path]:
    """A front-proxy CA and the apiserver's client certificate from it (CN FRONT_PROXY_CLIENT),
    written once into `out_dir`; -> their `front_proxy_paths`."""
    paths = front_proxy_paths(out_dir)
    if all(p.exists() for p in paths):
        return paths
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = "front-proxy-ca"
    ca_cert = _new_cert(ca_name, ca_name, ca_key.public_key(), ca_key, ca=True)
    cert = _new_cert(FRONT_PROXY_CLIENT, ca_name, key.public_key(), ca_key, ca=False,
                     usage=[ExtendedKeyUsageOID.CLIENT_AUTH])
    out_dir.mkdir(parents=True, exist_ok=True)
    ca_path, cert_path, key_path = paths
    key_path.touch(mode=0o600)
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert)
    ca_path.write_bytes(ca_cert)
    return paths


def fingerprint_of(cert: bytes) -> str:
    """SHA-256 of a certificate, given as PEM or DER (what `SSLSocket.getpeercert(True)` returns)."""
    der = ssl.PEM_cert_to_DER_cert(cert.decode()) if cert.lstrip().startswith(b"-----") else cert
    return hashlib.sha256(der).hexdigest()


def write_serving_cert(pki_dir: Path, out_dir: Path, name: str, ips: list[str]) -> tuple[Path, Path]:
    """Issue the node `name`'s serving certificate from `pki_dir`'s CA into `out_dir`; -> (cert, key) paths."""
    cert_pem, key_pem = issue_serving_cert((pki_dir / "ca.crt").read_bytes(), (pki_dir / "ca.key").read_bytes(),
                                           f"system:node:{name}", ips, [name])
    out_dir.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = out_dir / f"{name}.crt", out_dir / f"{name}.key"
    key_path.touch(mode=0o600)
    key_path.write_bytes(key_pem)
    cert_path.write_bytes(cert_pem)
    return cert_path, key_path
