"""Single sign-on from the CLI (the device flow, RFC 8628) and signing out
(``/v1/auth``; docs/identity.md)."""

from __future__ import annotations

from gpuclusters.client._session import Session
from gpuclusters.core.models import (
    SsoDevicePoll,
    SsoDeviceStart,
    SsoInfo,
    SsoPending,
    SsoSignedIn,
)


class AuthAPI:
    def __init__(self, session: Session) -> None:
        self._s = session

    def sso_info(self) -> SsoInfo:
        """Whether the server signs users in through an identity provider."""
        return self._s.get("/v1/auth/sso", SsoInfo)

    def start_device(self) -> SsoDeviceStart:
        """The page and code the user opens and enters at the identity provider."""
        return self._s.send("POST", "/v1/auth/sso/device", model=SsoDeviceStart)

    def poll_device(self, device_code: str) -> SsoSignedIn | SsoPending:
        """The session once the user has signed in; ``SsoPending`` until then."""
        body = SsoDevicePoll(device_code=device_code).model_dump()
        response = self._s.request("POST", "/v1/auth/sso/device/token", json=body)
        if response.status_code == 202:
            return self._s.parse(response, SsoPending)
        return self._s.parse(response, SsoSignedIn)

    def logout(self) -> None:
        """End this client's single sign-on session (its key stops working)."""
        self._s.request("POST", "/v1/auth/logout")
