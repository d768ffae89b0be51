"""Certificates for a local node's kubelet API, issued by the cluster's own CA.

The apiserver dials a kubelet over TLS and, with `--kubelet-certificate-authority`, verifies the
serving certificate against that CA with the node's InternalIP as the name: so the node gets a
certificate from kwokctl's CA (pki/ca.crt, ca.key) whose subjectAltName is its address. The other
direction, the apiserver's client certificate (`--kubelet-client-certificate`), is checked by the
kubelet API against the same CA and by fingerprint (`fingerprint_of`).
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import ssl
import warnings
from pathlib import Path

CERT_VALIDITY_DAYS = 365


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
