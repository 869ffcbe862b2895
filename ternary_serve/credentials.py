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

from ternary_serve.errors import ServeError
from ternary_serve.files import write_atomic

SERVICE_UID = 10001  # the user every image runs as (docker/Dockerfile)
API_KEY_FILE = "api-key"
TLS_FILE = "gateway.pem"
KEY_BYTES = 32  # 256 bits
CERT_DAYS = 825  # the longest validity browsers and most clients accept


class CredentialError(ServeError):
    """A secret that cannot be written where the containers read it; the message names the fix."""


def write_secret(path: Path, text: str, group: int | None = SERVICE_UID) -> None:
    """Write text in one rename, mode 0640, group SERVICE_UID: root and the containers read it.
    group None: a file only its owner reads (0600), such as the fleet's copies on the controller."""
    try:
        write_atomic(path, text, 0o600 if group is None else 0o640, group)
    except PermissionError:
        raise CredentialError(
            f"{path} must belong to group {SERVICE_UID} (the containers' user) to be read by "
            "them, and only root may give it that group: run this once as root (sudo make config)"
        ) from None


def new_api_key() -> str:
    return "ts-" + secrets.token_urlsafe(KEY_BYTES)


def ensure_api_key(path: Path, group: int | None = SERVICE_UID) -> bool:
    """Generate the host's API key once; an existing key is kept (rotate_key replaces it)."""
    if path.is_file() and path.read_text().strip():
        return False
    write_secret(path, new_api_key() + "\n", group)
    return True


def adopt_api_key(path: Path, source: Path) -> bool:
    """Serve with the key in source (a fleet's, shared by every replica) instead of one of this
    host's own. A server reads its key when it starts: a changed key needs a redeploy."""
    key = read_api_key(source)
    if not key:
        raise CredentialError(f"{source} holds no API key: run `ternary-serve fleet key` again")
    if path.is_file() and path.read_text().strip() == key:
        return False
    write_secret(path, key + "\n")
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


def ensure_tls(
    path: Path,
    cert: str,
    key: str,
    address: str,
    names: list[str] | None = None,
    group: int | None = SERVICE_UID,
) -> bool:
    """The gateway's certificate + key bundle: the operator's files (cert, key) when given, else
    one generated once for names (default: this host's name and localhost) and the published
    address."""
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
        write_secret(path, bundle, group)
        return True
    if path.is_file() and "PRIVATE KEY" in path.read_text():
        return False
    names = [*(names or [socket.getfqdn(), "localhost", "127.0.0.1", "::1"])]
    if address not in ("0.0.0.0", "::"):
        names.append(address)
    write_secret(path, self_signed(names), group)
    return True
