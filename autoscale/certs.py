"""A small CA and a serving certificate for the metrics adapter (tests, and `--self-signed` by hand).

In a cluster the Helm chart generates the pair and puts the CA into the APIService's `caBundle`
(the kube-apiserver verifies the adapter against it, for the name `<service>.<namespace>.svc`).
"""
from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class ServingCert:
    ca_cert: Path  # PEM, the caBundle
    cert: Path  # PEM, serving certificate
    key: Path  # PEM, its private key (mode 0600)
    ca_key: Path  # PEM, the CA's private key (mode 0600), to sign client certificates in tests


def _write(path: Path, data: bytes, private: bool = False) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def make_serving_cert(directory: str | os.PathLike, hosts: list[str], days: int = 365) -> ServingCert:
    """Write ca.crt, tls.crt, tls.key into `directory`; `hosts` are DNS names or IP addresses (SANs)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdserve-metrics-adapter-ca")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    out = ServingCert(d / "ca.crt", d / "tls.crt", d / "tls.key", d / "ca.key")
    _write(out.ca_key, _pem_key(ca_key), private=True)
    _write(out.ca_cert, ca.public_bytes(serialization.Encoding.PEM))
    _write(out.cert, cert.public_bytes(serialization.Encoding.PEM))
    _write(out.key, _pem_key(key), private=True)
    return out


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def make_client_cert(ca: ServingCert, directory: str | os.PathLike, common_name: str, days: int = 30) -> tuple[Path, Path]:
    """A client certificate signed by `ca` (e.g. the aggregator's front-proxy identity); returns (cert, key)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    ca_cert = x509.load_pem_x509_certificate(ca.ca_cert.read_bytes())
    ca_key = serialization.load_pem_private_key(ca.ca_key.read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = (d / f"{common_name}.crt", d / f"{common_name}.key")
    _write(paths[0], cert.public_bytes(serialization.Encoding.PEM))
    _write(paths[1], _pem_key(key), private=True)
    return paths
