"""A real identity provider for the single sign-on tests: Dex (built by
``scripts/build-k8s-addons dex``) with its local password database, users
with groups, and one client, this server. Its storage is SQLite in the
test's directory, so refresh tokens outlive a restart of Dex: the way a
test changes a user's groups, or disables them, is to rewrite Dex's
configuration and restart it, as an operator of a static Dex would.

``sign_in_device`` completes a device sign-in the way a person does in a
browser: it opens the verification page, submits the code, then the
email and password on Dex's login page (plain HTTP forms, driven with
httpx; the console's test drives the same pages in chromium).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from dataclasses import dataclass, field
from html import unescape
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import httpx

from gpuclusters.server.settings import Settings

# Built next to the metrics database's binaries (the add-ons' bin directory).
DEX_BIN = Settings().metrics_db_bin.parent / "dex"
# The bcrypt hash of "password" (Dex's own example configuration's).
PASSWORD = "password"
PASSWORD_HASH = "$2a$10$2b2cU8CPhOTaGrs1HRQuAueS7JTT5ZHsHSzYiFPm1leZck7Mc8T4W"
CLIENT_ID = "gpuclusters"


@dataclass
class DexUser:
    username: str
    groups: list[str] = field(default_factory=list)
    user_id: str = ""

    @property
    def email(self) -> str:
        return f"{self.username}@example.com"


class Dex:
    def __init__(
        self,
        root: Path,
        *,
        host: str,
        port: int,
        redirect_uris: list[str],
        users: list[DexUser],
        client_secret: str = "gpuclusters-test-secret",
    ) -> None:
        self.root = root
        self.host = host
        self.port = port
        self.redirect_uris = redirect_uris
        self.users = {u.username: u for u in users}
        for i, u in enumerate(users):
            u.user_id = u.user_id or f"00000000-0000-4000-8000-{i:012d}"
        self.client_secret = client_secret
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = root / "dex.log"
        root.mkdir(parents=True, exist_ok=True)

    @property
    def issuer(self) -> str:
        return f"http://{self.host}:{self.port}/dex"

    @property
    def _path(self) -> str:
        return urlsplit(self.issuer).path.rstrip("/")

    def config(self) -> dict[str, object]:
        return {
            "issuer": self.issuer,
            "storage": {"type": "sqlite3", "config": {"file": str(self.root / "dex.db")}},
            "web": {"http": f"{self.host}:{self.port}"},
            "logger": {"level": "info"},
            "oauth2": {
                "skipApprovalScreen": True,
                "responseTypes": ["code"],
                "grantTypes": [
                    "authorization_code",
                    "refresh_token",
                    "urn:ietf:params:oauth:grant-type:device_code",
                ],
            },
            "expiry": {"deviceRequests": "5m", "idTokens": "10m"},
            "staticClients": [
                {
                    "id": CLIENT_ID,
                    "name": "gpuclusters",
                    "secret": self.client_secret,
                    # The device flow's callback is on Dex itself, under its
                    # issuer's path.
                    "redirectURIs": [*self.redirect_uris, f"{self._path}/device/callback"],
                }
            ],
            "enablePasswordDB": True,
            "staticPasswords": [
                {
                    "email": u.email,
                    "hash": PASSWORD_HASH,
                    "username": u.username,
                    "preferredUsername": u.username,
                    "userID": u.user_id,
                    "groups": u.groups,
                }
                for u in self.users.values()
            ],
        }

    def start(self) -> None:
        path = self.root / "config.json"  # JSON is YAML
        path.write_text(json.dumps(self.config(), indent=1))
        log = self.log.open("ab")
        self.proc = subprocess.Popen([str(DEX_BIN), "serve", str(path)], stdout=log, stderr=log)
        deadline = time.monotonic() + 30
        url = f"{self.issuer}/.well-known/openid-configuration"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dex exited: {self.log.read_text()[-3000:]}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"dex did not answer: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        """Take up a changed configuration (users, groups)."""
        self.stop()
        self.start()


_FORM = re.compile(r'<form[^>]*method="post"[^>]*action="([^"]*)"', re.I)
_INPUT = re.compile(r"<input[^>]*>", re.I)
_ATTR = re.compile(r'(\w+)="([^"]*)"')


def _form(page: httpx.Response) -> tuple[str, dict[str, str]]:
    found = _FORM.search(page.text)
    if found is None:
        raise AssertionError(f"no form on {page.url}:\n{page.text[:2000]}")
    fields = {}
    for tag in _INPUT.findall(page.text):
        attrs = dict(_ATTR.findall(tag))
        if "name" in attrs and attrs.get("type") != "checkbox":
            fields[attrs["name"]] = unescape(attrs.get("value", ""))
    return urljoin(str(page.url), unescape(found[1])), fields


def sign_in_device(
    verification_uri: str, user_code: str, *, email: str, password: str = PASSWORD
) -> str:
    """Complete a device sign-in at Dex as a person would; the final page's
    text (Dex's "Login Successful")."""
    with httpx.Client(follow_redirects=True, timeout=30) as browser:
        page = browser.get(verification_uri)
        action, fields = _form(page)
        fields["user_code"] = user_code
        page = browser.post(action, data=fields)
        action, fields = _form(page)  # the password login
        fields.update(login=email, password=password)
        page = browser.post(action, data=fields)
        if page.status_code == 401:
            raise PermissionError(f"Dex refused {email}'s sign-in")
        if "approval" in str(page.url):
            action, fields = _form(page)
            page = browser.post(action, data={**fields, "approval": "approve"})
        page.raise_for_status()
        return page.text


def sign_in_browser(authorize_url: str, *, email: str, password: str = PASSWORD) -> str:
    """Follow an authorization request at Dex as a browser would, sign in
    on its login page, and return where Dex sends the browser back (the
    client's redirect URI with the code), without following it."""
    with httpx.Client(follow_redirects=False, timeout=30) as browser:
        page = browser.get(authorize_url)
        while page.is_redirect:
            page = browser.get(page.next_request.url if page.next_request else "")
        action, fields = _form(page)
        fields.update(login=email, password=password)
        sent = browser.post(action, data=fields)
        while sent.is_redirect:
            location = sent.headers["location"]
            if not location.startswith(("/", str(sent.url)[: len(str(sent.url).split("/dex")[0])])):
                return location  # leaving Dex: the client's redirect URI
            assert sent.next_request is not None
            sent = browser.get(sent.next_request.url)
        raise AssertionError(f"Dex did not send the browser back:\n{sent.text[:2000]}")
