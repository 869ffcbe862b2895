"""How a client on this host reaches the deployed API: its URL (the gateway's, with TLS, when it is
on), the API key and the certificate to trust. Used by `make bench`, the deploy's messages and the
tests: the same path an operator's own client takes."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import requests

from ternary_serve import credentials


def gateway(env: dict[str, str]) -> bool:
    return "gateway" in env.get("COMPOSE_PROFILES", "").split(",")


def published_url(env: dict[str, str]) -> str:
    """The API's base URL from this host: the gateway's (https) or the server's own port."""
    address = env["PUBLISH_ADDRESS"]
    host = "127.0.0.1" if address in ("0.0.0.0", "::") else address
    host = f"[{host}]" if ":" in host else host
    return f"{'https' if gateway(env) else 'http'}://{host}:{env['PUBLISH_PORT']}"


@dataclass(frozen=True)
class Endpoint:
    url: str  # base URL, without /v1
    api_key: str | None = None
    verify: str | bool = True  # a certificate file to trust (the gateway's), or the system's CAs

    @classmethod
    def of(cls, env: dict[str, str]) -> Endpoint:
        """The endpoint a rendered .env publishes, as seen from this host."""
        return cls(
            url=published_url(env),
            api_key=credentials.read_api_key(Path(env["API_KEY_FILE"])),
            verify=env["GATEWAY_TLS_FILE"] if gateway(env) else True,
        )

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def session(self) -> requests.Session:
        session = requests.Session()
        session.headers.update(self.headers)
        session.verify = self.verify
        # requests prefers REQUESTS_CA_BUNDLE from the environment over a session's certificate.
        session.trust_env = self.verify is True
        return session

    def openai(self, **options):
        """The official client, as users call the API."""
        import openai

        trust = ssl.create_default_context(cafile=self.verify) if self.verify is not True else True
        return openai.OpenAI(
            base_url=f"{self.url}/v1",
            api_key=self.api_key or "none",
            http_client=openai.DefaultHttpxClient(verify=trust),
            **options,
        )
