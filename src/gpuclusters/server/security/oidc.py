"""The server as an OpenID Connect client of the organization's identity
provider (docs/identity.md).

The server, not the CLI or the browser, holds the client secret and the
provider's refresh tokens: the CLI's device flow (RFC 8628) and the
console's authorization-code flow (with PKCE) both go through it, and what
a user takes away is a session of this server's, never a provider token or
a password.

ID tokens are checked here in full: the signature against the provider's
published keys (``jwks_uri``, refetched once when a token names a key not
seen yet, so a key rotation needs no restart), the issuer (exactly the
configured one), the audience (this client), expiry and issue time (30 s of
clock skew), and the nonce where the flow sent one. A token from another
issuer, for another client, or with a bad signature is refused.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import secrets
import ssl
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import httpx
import jwt

DEVICE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"
CLOCK_SKEW_S = 30
DISCOVERY_TTL_S = 3600.0
# How long a token request may take. Long on purpose: a provider that
# rotates refresh tokens (Dex, Okta) has rotated once it answers, so a
# refresh the client gives up on loses the grant, and the next refresh with
# the old token is refused as a replay. Dex on a loaded machine was seen
# answering after 25 s.
TOKEN_TIMEOUT_S = 60.0
ALGORITHMS = ["RS256", "RS384", "RS512", "ES256", "ES384", "ES512", "PS256", "EdDSA"]


class OidcError(Exception):
    """The provider refused, or answered what cannot be trusted."""


class OidcUnavailableError(OidcError):
    """The provider could not be reached or failed (try again later)."""


class InvalidGrantError(OidcError):
    """The provider refused a grant (an OAuth error code): for a refresh,
    the user was disabled or removed, or the grant expired or was revoked."""


@dataclass(frozen=True, slots=True)
class Tokens:
    id_token: str
    claims: dict[str, Any]
    refresh_token: str | None


@dataclass(frozen=True, slots=True)
class DeviceStart:
    device_code: str
    user_code: str
    verification_uri: str
    verification_uri_complete: str | None
    interval: int
    expires_in: int


@dataclass(frozen=True, slots=True)
class Pending:
    """The user has not finished at the provider yet (poll again)."""

    slow_down: bool


def _unreachable(url: str, exc: httpx.HTTPError) -> OidcUnavailableError:
    return OidcUnavailableError(f"identity provider at {url}: {type(exc).__name__} {exc}".strip())


def pkce_pair() -> tuple[str, str]:
    """A PKCE verifier and its S256 challenge (RFC 7636)."""
    verifier = secrets.token_urlsafe(48)
    digest = hashlib.sha256(verifier.encode()).digest()
    return verifier, base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


class OidcClient:
    def __init__(
        self,
        *,
        issuer: str,
        client_id: str,
        client_secret: str,
        scopes: list[str],
        verify: ssl.SSLContext | bool = True,
        timeout_s: float = 10.0,
    ) -> None:
        self.issuer = issuer.rstrip("/")
        self.client_id = client_id
        self._secret = client_secret
        self.scopes = scopes
        self._http = httpx.AsyncClient(verify=verify, timeout=timeout_s)
        self._discovery: dict[str, Any] | None = None
        self._discovered_at = 0.0
        self._keys: dict[str, jwt.PyJWK] = {}
        self._lock = asyncio.Lock()

    async def close(self) -> None:
        await self._http.aclose()

    # --- the provider's documents ------------------------------------------

    async def _get_json(self, url: str) -> dict[str, Any]:
        try:
            r = await self._http.get(url)
        except httpx.HTTPError as exc:
            raise _unreachable(url, exc) from exc
        if r.status_code != 200:
            raise OidcUnavailableError(f"identity provider at {url}: HTTP {r.status_code}")
        try:
            data = r.json()
        except ValueError as exc:
            raise OidcUnavailableError(f"identity provider at {url}: not JSON") from exc
        if not isinstance(data, dict):
            raise OidcUnavailableError(f"identity provider at {url}: not a JSON object")
        return data

    async def discovery(self) -> dict[str, Any]:
        async with self._lock:
            fresh = time.monotonic() - self._discovered_at < DISCOVERY_TTL_S
            if self._discovery is None or not fresh:
                doc = await self._get_json(f"{self.issuer}/.well-known/openid-configuration")
                if str(doc.get("issuer", "")).rstrip("/") != self.issuer:
                    raise OidcError(
                        f"the provider's discovery names issuer {doc.get('issuer')!r}, "
                        f"not {self.issuer!r}"
                    )
                self._discovery = doc
                self._discovered_at = time.monotonic()
            return self._discovery

    async def _endpoint(self, name: str) -> str:
        url = (await self.discovery()).get(name)
        if not isinstance(url, str) or not url:
            raise OidcError(f"the identity provider publishes no {name}")
        return url

    async def _key(self, kid: str | None) -> jwt.PyJWK:
        for attempt in range(2):
            if kid in self._keys or (kid is None and len(self._keys) == 1):
                return self._keys[kid] if kid is not None else next(iter(self._keys.values()))
            if attempt == 0:
                jwks = await self._get_json(await self._endpoint("jwks_uri"))
                keys: dict[str, jwt.PyJWK] = {}
                for data in jwks.get("keys", []):
                    if isinstance(data, dict) and data.get("use", "sig") == "sig":
                        try:
                            key = jwt.PyJWK(data)
                        except jwt.PyJWTError:
                            continue
                        keys[str(data.get("kid", ""))] = key
                self._keys = keys
        raise OidcError(f"the ID token is signed with a key the provider does not publish ({kid})")

    # --- tokens ---------------------------------------------------------------

    async def verify_id_token(self, token: str, *, nonce: str | None = None) -> dict[str, Any]:
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError as exc:
            raise OidcError(f"not an ID token: {exc}") from exc
        key = await self._key(header.get("kid"))
        try:
            claims: dict[str, Any] = jwt.decode(
                token,
                key=key.key,
                algorithms=[header.get("alg", "")] if header.get("alg") in ALGORITHMS else [],
                audience=self.client_id,
                issuer=self.issuer,
                leeway=CLOCK_SKEW_S,
                options={"require": ["exp", "iat", "iss", "aud", "sub"]},
            )
        except jwt.PyJWTError as exc:
            raise OidcError(f"the ID token is not valid: {exc}") from exc
        if nonce is not None and claims.get("nonce") != nonce:
            raise OidcError("the ID token's nonce is not this sign-in's")
        return claims

    async def _token(self, form: dict[str, str]) -> dict[str, Any]:
        url = await self._endpoint("token_endpoint")
        try:
            r = await self._http.post(
                url, data=form, auth=(self.client_id, self._secret), timeout=TOKEN_TIMEOUT_S
            )
        except httpx.HTTPError as exc:
            raise _unreachable(url, exc) from exc
        try:
            data = r.json()
        except ValueError:
            data = {}
        if not isinstance(data, dict):
            data = {}
        if r.status_code == 200:
            return data
        error = str(data.get("error", ""))
        if error in ("authorization_pending", "slow_down"):
            return data
        what = f"{error}: {data.get('error_description', '')}".strip(": ")
        # An answer with an OAuth error code is the provider's decision, even
        # with a 5xx: Dex answers a refresh for a user it no longer has with
        # 500 invalid_request. Only a failure without one, or the codes that
        # say so, is the provider being unwell (retried later).
        if error and error not in ("server_error", "temporarily_unavailable"):
            raise InvalidGrantError(f"{what} (HTTP {r.status_code})")
        if r.status_code >= 500 or error:
            raise OidcUnavailableError(f"identity provider: HTTP {r.status_code} {what}".strip())
        raise OidcError(f"identity provider refused: HTTP {r.status_code}")

    async def _tokens(self, data: dict[str, Any], *, nonce: str | None = None) -> Tokens:
        id_token = data.get("id_token")
        if not isinstance(id_token, str):
            raise OidcError("the provider's answer has no ID token (is 'openid' in the scopes?)")
        claims = await self.verify_id_token(id_token, nonce=nonce)
        refresh = data.get("refresh_token")
        return Tokens(id_token, claims, refresh if isinstance(refresh, str) else None)

    async def refresh(self, refresh_token: str) -> Tokens:
        """New tokens for a refresh token (the provider re-reads the user:
        a disabled user gets InvalidGrantError)."""
        data = await self._token({"grant_type": "refresh_token", "refresh_token": refresh_token})
        tokens = await self._tokens(data)
        if tokens.refresh_token is None:
            # Providers that do not rotate keep the old one valid.
            return Tokens(tokens.id_token, tokens.claims, refresh_token)
        return tokens

    # --- the device flow (RFC 8628) ----------------------------------------------

    async def start_device(self) -> DeviceStart:
        url = await self._endpoint("device_authorization_endpoint")
        # The secret in the form as well as in the header: Dex reads it
        # from the form for a device request (RFC 6749 allows both).
        form = {
            "client_id": self.client_id,
            "client_secret": self._secret,
            "scope": " ".join(self.scopes),
        }
        try:
            r = await self._http.post(url, data=form)
        except httpx.HTTPError as exc:
            raise _unreachable(url, exc) from exc
        if r.status_code != 200:
            raise OidcUnavailableError(f"identity provider at {url}: HTTP {r.status_code}")
        data = r.json()
        try:
            return DeviceStart(
                device_code=str(data["device_code"]),
                user_code=str(data["user_code"]),
                verification_uri=str(data["verification_uri"]),
                verification_uri_complete=data.get("verification_uri_complete"),
                interval=int(data.get("interval", 5)),
                expires_in=int(data.get("expires_in", 300)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise OidcError(f"the provider's device answer is incomplete: {exc}") from exc

    async def poll_device(self, device_code: str) -> Tokens | Pending:
        data = await self._token({"grant_type": DEVICE_GRANT, "device_code": device_code})
        error = data.get("error")
        if error in ("authorization_pending", "slow_down"):
            return Pending(slow_down=error == "slow_down")
        return await self._tokens(data)

    # --- the authorization-code flow (the console) ------------------------------------

    async def authorization_url(
        self, *, redirect_uri: str, state: str, nonce: str, code_challenge: str
    ) -> str:
        url = await self._endpoint("authorization_endpoint")
        query = {
            "response_type": "code",
            "client_id": self.client_id,
            "redirect_uri": redirect_uri,
            "scope": " ".join(self.scopes),
            "state": state,
            "nonce": nonce,
            "code_challenge": code_challenge,
            "code_challenge_method": "S256",
        }
        return f"{url}?{urlencode(query)}"

    async def exchange_code(
        self, *, code: str, redirect_uri: str, verifier: str, nonce: str
    ) -> Tokens:
        data = await self._token(
            {
                "grant_type": "authorization_code",
                "code": code,
                "redirect_uri": redirect_uri,
                "code_verifier": verifier,
            }
        )
        return await self._tokens(data, nonce=nonce)


def describe(claims: dict[str, Any]) -> str:
    """A short, log-safe description of who the claims are."""
    return json.dumps({k: claims.get(k) for k in ("sub", "email", "preferred_username")})
