"""The image registry's bearer tokens: the signing key, the key set the
registry trusts, the clusters' pull credentials.

Distribution's ``token`` auth (docs/kubernetes.md "Images") verifies every
request's JWT against a JSON Web Key Set file; the server signs those JWTs
(ES256) with a key it makes once in ``$GPUCLUSTERS_HOME/registry/``::

    token-key.pem   the ECDSA P-256 signing key (0600)
    jwks.json       its public half as a JWK set (``kid`` = RFC 7638 thumbprint)

Clusters' nodes pull with a *pull credential* (containerd's registry auth):
user name ``cluster-<cluster id>`` and a password that is an HMAC of that
name under a secret derived from the signing key, so nothing more is stored
and a new key (deleting the directory) revokes every credential at once.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from jwt.algorithms import ECAlgorithm

from gpuclusters.core.clientconfig import replace_atomically

REGISTRY_DIR = "registry"
KEY_FILE = "token-key.pem"
JWKS_FILE = "jwks.json"
ISSUER = "gpuclusters"
SERVICE = "gpuclusters-registry"
TOKEN_TTL_S = 900  # long enough for one large push; clients renew on 401
CLUSTER_USER_PREFIX = "cluster-"


@dataclass(frozen=True, slots=True)
class RegistryKeys:
    dir: Path
    key: ec.EllipticCurvePrivateKey
    kid: str

    @property
    def jwks_file(self) -> Path:
        return self.dir / JWKS_FILE

    def mint(
        self, *, subject: str, access: list[dict[str, Any]], ttl_s: int = TOKEN_TTL_S
    ) -> tuple[str, int]:
        """A signed token for ``access`` (the grants' claims); ``(token, now)``."""
        now = int(time.time())
        claims = {
            "iss": ISSUER,
            "sub": subject,
            "aud": SERVICE,
            "iat": now,
            "nbf": now - 5,  # small clock skew between the registry and us
            "exp": now + ttl_s,
            "jti": secrets.token_hex(16),
            "access": access,
        }
        token = jwt.encode(claims, self.key, algorithm="ES256", headers={"kid": self.kid})
        return token, now

    def _pull_secret(self) -> bytes:
        raw = self.key.private_numbers().private_value.to_bytes(32, "big")
        return hashlib.sha256(b"gpuclusters registry pull credentials\0" + raw).digest()

    def cluster_credential(self, cluster_id: str) -> tuple[str, str]:
        """The ``(user, password)`` a cluster's nodes pull with."""
        user = CLUSTER_USER_PREFIX + cluster_id
        return user, hmac.new(self._pull_secret(), user.encode(), hashlib.sha256).hexdigest()

    def cluster_of(self, user: str, password: str) -> str | None:
        """The cluster id whose pull credential this is, else ``None``."""
        if not user.startswith(CLUSTER_USER_PREFIX):
            return None
        cluster_id = user[len(CLUSTER_USER_PREFIX) :]
        _, expected = self.cluster_credential(cluster_id)
        return cluster_id if hmac.compare_digest(expected, password) else None


def _thumbprint(jwk: dict[str, Any]) -> str:
    """RFC 7638: SHA-256 over the required members, sorted, no spaces."""
    required = {k: jwk[k] for k in ("crv", "kty", "x", "y")}
    digest = hashlib.sha256(json.dumps(required, separators=(",", ":"), sort_keys=True).encode())
    return base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()


def ensure_registry_keys(home: Path) -> RegistryKeys:
    """Load the signing key, making it (and the key set) on first use."""
    directory = home / REGISTRY_DIR
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    key_path = directory / KEY_FILE
    if key_path.exists():
        loaded = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        if not isinstance(loaded, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{key_path}: not an ECDSA key")
        key = loaded
    else:
        key = ec.generate_private_key(ec.SECP256R1())
        pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        replace_atomically(key_path, pem, mode=0o600)
    jwk: dict[str, Any] = json.loads(ECAlgorithm.to_jwk(key.public_key()))
    kid = _thumbprint(jwk)
    jwk.update({"kid": kid, "use": "sig", "alg": "ES256"})
    body = json.dumps({"keys": [jwk]}, indent=2, sort_keys=True).encode()
    jwks_path = directory / JWKS_FILE
    if not jwks_path.exists() or jwks_path.read_bytes() != body:
        replace_atomically(jwks_path, body, mode=0o644)
    return RegistryKeys(dir=directory, key=key, kid=kid)
