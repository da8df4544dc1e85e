"""Short-lived Kubernetes tokens for users (docs/identity.md): the server is
an OpenID Connect issuer whose only audience is its clusters' apiservers.

``gpuclusters clusters credentials`` writes a kubeconfig whose user runs
``gpuclusters clusters token`` (client-go's exec credential plugin) at each
kubectl run; that asks the server (``POST .../clusters/{name}/token``),
which checks the caller's membership *now* and signs a JWT for five
minutes: ``sub`` the user's name (the name their RBAC bindings carry),
``groups`` ``gpuclusters:users``, ``aud`` ``gpuclusters:<cluster id>`` (a
token for one cluster opens no other). Each apiserver trusts these through
a structured ``AuthenticationConfiguration`` (``layers/kubernetes``): the
issuer, the audience, the claims to read, and where to read the keys from
(the discovery document and JWKS, served on the listener nodes may reach).
So a membership removed, or a user locked out, is refused at the next
kubectl run, not when a certificate expires.

The signing key is an EC P-256 key in ``$GPUCLUSTERS_HOME/cluster-tokens``
(mode 0600), made at the first start; replicas share the home.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from gpuclusters.core.clientconfig import replace_atomically

KEY_DIR = "cluster-tokens"
KEY_FILE = "signing-key.pem"
TOKEN_TTL = timedelta(minutes=5)
USERS_GROUP = "gpuclusters:users"
DISCOVERY_PATH = "/.well-known/openid-configuration"
JWKS_PATH = "/v1/oidc/jwks"


def audience_of(cluster_id: str) -> str:
    return f"gpuclusters:{cluster_id}"


def ensure_signing_key(home: Path) -> bytes:
    """The signing key's PEM, made when missing. Blocking; idempotent."""
    directory = home / KEY_DIR
    path = directory / KEY_FILE
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        key = ec.generate_private_key(ec.SECP256R1())
        pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        replace_atomically(path, pem, mode=0o600)
    return path.read_bytes()


@dataclass(frozen=True, slots=True)
class ClusterToken:
    token: str
    expires_at: datetime


class TokenIssuer:
    def __init__(self, key_pem: bytes, issuer: str) -> None:
        key = serialization.load_pem_private_key(key_pem, password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError("the cluster token signing key must be an EC key")
        self._key = key
        self.issuer = issuer
        public = key.public_key()
        jwk: dict[str, Any] = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(public))
        # RFC 7638 thumbprint as the key id.
        canonical = json.dumps(
            {k: jwk[k] for k in ("crv", "kty", "x", "y")}, separators=(",", ":"), sort_keys=True
        )
        self.kid = hashlib.sha256(canonical.encode()).hexdigest()[:32]
        self.jwk = {**jwk, "kid": self.kid, "use": "sig", "alg": "ES256"}

    def mint(self, *, user: str, cluster_id: str, now: datetime | None = None) -> ClusterToken:
        issued = now or datetime.now(UTC)
        expires = issued + TOKEN_TTL
        claims = {
            "iss": self.issuer,
            "sub": user,
            "aud": audience_of(cluster_id),
            "groups": [USERS_GROUP],
            "iat": int(issued.timestamp()),
            "nbf": int(issued.timestamp()) - 30,
            "exp": int(expires.timestamp()),
        }
        token = jwt.encode(claims, self._key, algorithm="ES256", headers={"kid": self.kid})
        return ClusterToken(token=token, expires_at=expires.replace(microsecond=0))

    def discovery(self, base_url: str) -> dict[str, Any]:
        """The discovery document, with the key set at ``base_url`` (the
        listener it was fetched from: the apiserver reads both there)."""
        return {
            "issuer": self.issuer,
            "jwks_uri": base_url.rstrip("/") + JWKS_PATH,
            "response_types_supported": ["id_token"],
            "subject_types_supported": ["public"],
            "id_token_signing_alg_values_supported": ["ES256"],
            "claims_supported": ["sub", "groups", "aud", "iss", "exp", "iat"],
        }

    def jwks(self) -> dict[str, Any]:
        return {"keys": [self.jwk]}
