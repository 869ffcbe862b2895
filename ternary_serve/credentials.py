"""The stack's secrets on the host: the API key and the gateway's TLS certificate.

Both live in the state directory, never in an image, .env, a log or the release history. Compose
hands them to the containers as secrets (bind mounts of these files), so the files are readable by
root and by the containers' group only: mode 0640, group 10001 (the images' service user).
"""

from __future__ import annotations

import datetime
import ipaddress
import secrets
import socket
from pathlib import Path

from ternary_serve import envfile

SERVICE_UID = 10001  # the user every image runs as (docker/Dockerfile)
API_KEY_FILE = "api-key"
TLS_FILE = "gateway.pem"
KEY_BYTES = 32  # 256 bits
CERT_DAYS = 825  # the longest validity browsers and most clients accept


class CredentialError(Exception):
    """A secret that cannot be written where the containers read it; the message names the fix."""


def write_secret(path: Path, text: str) -> None:
    """Write text in one rename, mode 0640, group SERVICE_UID: root and the containers read it."""
    try:
        envfile.write_atomic(path, text, 0o640, SERVICE_UID)
    except PermissionError:
        raise CredentialError(
            f"{path} must belong to group {SERVICE_UID} (the containers' user) to be read by "
            "them, and only root may give it that group: run this once as root (sudo make config)"
        ) from None


def new_api_key() -> str:
    return "ts-" + secrets.token_urlsafe(KEY_BYTES)


def ensure_api_key(path: Path) -> bool:
    """Generate the host's API key once; an existing key is kept (rotate_key replaces it)."""
    if path.is_file() and path.read_text().strip():
        return False
    write_secret(path, new_api_key() + "\n")
    return True


def read_api_key(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError as exc:
        raise CredentialError(
            f"cannot read the API key {path}: {exc.strerror} (run `make config`, as root)"
        ) from None


def self_signed(names: list[str]) -> str:
    """A self-signed certificate and its key (PEM, as HAProxy reads them) for these host names
    and addresses; clients trust it by pinning the certificate file."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])])
    alt: list[x509.GeneralName] = []
    for name in dict.fromkeys(names):
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alt.append(x509.DNSName(name))
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    return (
        cert.public_bytes(serialization.Encoding.PEM).decode()
        + key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ).decode()
    )


def ensure_tls(path: Path, cert: str, key: str, address: str) -> bool:
    """The gateway's certificate + key bundle: the operator's files (cert, key) when given, else
    one generated once for this host's name, localhost and the published address."""
    if cert:
        try:
            bundle = Path(cert).read_text().rstrip("\n") + "\n" + Path(key).read_text()
        except OSError as exc:
            raise CredentialError(
                f"TLS_CERT/TLS_KEY: cannot read {exc.filename}: {exc.strerror}"
            ) from None
        if "PRIVATE KEY" not in bundle or "CERTIFICATE" not in bundle:
            raise CredentialError(
                "TLS_CERT must be a PEM certificate (chain) and TLS_KEY its PEM private key"
            )
        if path.is_file() and path.read_text() == bundle:
            return False
        write_secret(path, bundle)
        return True
    if path.is_file() and "PRIVATE KEY" in path.read_text():
        return False
    names = [socket.getfqdn(), "localhost", "127.0.0.1", "::1"]
    if address not in ("0.0.0.0", "::"):
        names.append(address)
    write_secret(path, self_signed(names))
    return True
