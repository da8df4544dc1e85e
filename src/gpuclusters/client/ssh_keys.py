"""``client.ssh_keys``: the caller's SSH public keys, and the organization's
SSH certificate authorities.

These paths are not under ``/v1/projects/{project}``, so they ignore the
client's project. Keys are the caller's own; nobody else's are visible.
"""

from __future__ import annotations

import builtins

from gpuclusters.client._session import Session, quote_name
from gpuclusters.core.models import SshCa, SshKey


class SshKeysAPI:
    def __init__(self, session: Session) -> None:
        self._s = session

    def list(self) -> builtins.list[SshKey]:
        """The caller's live keys, oldest first."""
        return self._s.get_list("/v1/ssh-keys", SshKey)

    def add(self, public_key: str, *, name: str | None = None) -> SshKey:
        """Register one OpenSSH public key line (what ``id_ed25519.pub``
        holds); ``name`` defaults to the key's comment. A bad key raises
        :class:`~gpuclusters.core.errors.ValidationError` (field
        ``public_key``), a key the caller already has
        :class:`~gpuclusters.core.errors.AlreadyExistsError`."""
        body: dict[str, str] = {"public_key": public_key}
        if name is not None:
            body["name"] = name
        return self._s.send("POST", "/v1/ssh-keys", model=SshKey, json=body)

    def delete(self, key: str) -> None:
        """Delete one of the caller's keys by id or fingerprint."""
        self._s.request("DELETE", f"/v1/ssh-keys/{quote_name(key)}")

    def ca(self) -> SshCa:
        """The organization's user and host CA public keys, the gateway host
        and the ``@cert-authority`` known_hosts line for it."""
        return self._s.get("/v1/ssh-ca", SshCa)
