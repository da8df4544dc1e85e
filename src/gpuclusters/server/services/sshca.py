"""Organizations' SSH certificate authorities, and what clients need to
trust them.

Each organization has two Ed25519 CAs (``core.sshca``), made on first use:
``user`` signs members' short-lived login keys (``POST .../ssh-certificate``),
``host`` signs nodes' host keys (the access sync). Their private keys live
only in the database.

``GET /v1/ssh-ca`` hands out both public keys and an ``@cert-authority``
known_hosts line for the gateway host. Every cluster's login node is
reached on its own gateway port, so the line names the gateway on *every*
port (``[HOST]:*``) as well as port 22 (``HOST``): one line in a
known_hosts file trusts every cluster of the organization, now and later.
"""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core import models as api
from gpuclusters.core import sshca
from gpuclusters.server.db.models import Organization
from gpuclusters.server.db.ssh import org_authority
from gpuclusters.server.runtime import Runtime
from gpuclusters.server.security.principal import Principal


def gateway_patterns(gateway_host: str) -> list[str]:
    """known_hosts patterns for the gateway host on any port: ssh looks a
    non-22 port up as ``[HOST]:PORT``, which ``[HOST]:*`` matches."""
    return [f"[{gateway_host}]:*", gateway_host]


def gateway_known_hosts(*, host_ca_public: str, gateway_host: str, organization: str) -> str:
    """``@cert-authority [HOST]:*,HOST <host CA key> gpuclusters:<org>``."""
    return sshca.known_hosts_line(
        host_ca_public, gateway_patterns(gateway_host), f"gpuclusters:{organization}"
    )


async def ssh_ca(session: AsyncSession, *, rt: Runtime, principal: Principal) -> api.SshCa:
    """The caller's organization's CAs (made if needed) and the known_hosts
    line for its gateway."""
    org = await session.get_one(Organization, principal.organization_id)
    user_ca = await org_authority(session, org.id, "user")
    host_ca = await org_authority(session, org.id, "host")
    await session.commit()
    gateway = rt.settings.gateway_host
    return api.SshCa(
        user_ca_public_key=user_ca.public_key,
        host_ca_public_key=host_ca.public_key,
        gateway_host=gateway,
        known_hosts=gateway_known_hosts(
            host_ca_public=host_ca.public_key, gateway_host=gateway, organization=org.name
        ),
    )
