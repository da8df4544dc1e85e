"""The web console in a real browser: Playwright driving Debian's chromium
against a real server process (fake provider, so nodes boot in a second).

As a user: sign in with an API key (a wrong one is refused), create a
cluster from the form (a bad GPU count gets the API's own message), watch
it become ready without reloading the page, scale it, see as an editor no
button an editor may not press and have a forged delete refused, delete it
keeping its volume, sign out. Each test saves a screenshot of the page into
its tmp_path when it fails; ``GPUCLUSTERS_SCREENSHOTS=DIR`` also keeps the
overview's (the README's picture is one of those).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import playwright.sync_api as playwright_api
import pytest
import yaml

if TYPE_CHECKING:
    from support.servers import ServerHandle, Servers

CHROMIUM = shutil.which("chromium")

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="run scripts/setup first (Debian's chromium)"),
]


@pytest.fixture
def server(server_factory: Servers) -> ServerHandle:
    # Nodes take a second to boot, so the phases can be watched.
    return server_factory(boot_delay_s=1.0)


@pytest.fixture
def browser() -> Iterator[playwright_api.Browser]:
    with playwright_api.sync_playwright() as p:
        # Playwright's own browser download cannot work here: the system's.
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


@contextlib.contextmanager
def screenshot_on_failure(page: playwright_api.Page, path: Path) -> Iterator[None]:
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            page.screenshot(path=str(path), full_page=True)
            print(f"screenshot of the failing page: {path} ({page.url})")
        raise


def sign_in(page: playwright_api.Page, url: str, key: str) -> None:
    page.goto(f"{url}/login")
    page.fill("#api_key", key)
    page.click("button[type=submit]")
    page.wait_for_url(f"{url}/")


def test_sign_in_create_watch_scale_delete_sign_out(
    server: ServerHandle, browser: playwright_api.Browser, tmp_path: Path
) -> None:
    expect = playwright_api.expect
    page = browser.new_page()
    with screenshot_on_failure(page, tmp_path / "admin.png"):
        # Anything but the sign-in page needs a session.
        page.goto(f"{server.url}/")
        expect(page).to_have_url(f"{server.url}/login")
        page.fill("#api_key", "gpc_not-a-key")
        page.click("button[type=submit]")
        expect(page.locator(".error")).to_contain_text("invalid or revoked API key")
        sign_in(page, server.url, server.api_key)
        expect(page.locator("h1")).to_have_text("Clusters")

        # Create from the form: the API's validation, word for word.
        page.click("#new-cluster-default")
        page.fill("#name", "web1")
        page.select_option("#cluster_type", "slurm")
        page.fill("#num_gpus", "12")
        page.click("#new-cluster button[type=submit]")
        with server.client() as api:
            bad = {"name": "web1", "cluster_type": "slurm", "num_gpus": 12}
            r = api.post("/v1/projects/default/clusters", json=bad)
        assert r.status_code == 422
        expect(page.locator(".error")).to_have_text(r.json()["message"])
        assert page.locator(".error").get_attribute("data-field") == "num_gpus"
        page.fill("#num_gpus", "16")
        page.click("#new-cluster button[type=submit]")
        page.wait_for_url(f"{server.url}/projects/default/clusters/web1")

        # It becomes ready while the page stays loaded (htmx polls it).
        page.evaluate("window.__stillTheSamePage = true")
        expect(page.locator("#cluster h1 .status")).to_have_text("ready", timeout=60_000)
        assert page.evaluate("window.__stillTheSamePage") is True
        phases = page.locator("#phases li").all_inner_texts()
        assert any("ready" in p for p in phases) and len(phases) >= 2, phases
        expect(page.locator("#nodes tbody tr")).to_have_count(2)

        # Scale to three nodes; the node table follows by itself.
        page.fill("#scale #num_gpus", "24")
        page.click("#scale button[type=submit]")
        page.wait_for_url(f"{server.url}/projects/default/clusters/web1")
        page.evaluate("window.__stillTheSamePage = true")
        expect(page.locator("#nodes tbody tr")).to_have_count(3, timeout=60_000)
        expect(page.locator("#cluster h1 .status")).to_have_text("ready", timeout=60_000)
        assert page.evaluate("window.__stillTheSamePage") is True

        # Configure: a bad prolog gets the API's message; a good one is saved.
        page.fill("#prolog", "echo no interpreter line")
        page.click("#configure button[type=submit]")
        expect(page.locator("p.error")).to_contain_text("must start with an interpreter line")
        page.fill("#repair_automatic", "*")
        page.fill("#repair_max_wait_s", "0")
        page.fill("#prolog", "#!/bin/bash\necho prolog")
        page.click("#configure button[type=submit]")
        expect(page.locator("p.error")).to_have_count(0)
        with server.client() as api:
            saved = api.get("/v1/projects/default/clusters/web1").json()
        assert saved["repair"]["automatic"] == ["*"] and saved["repair"]["max_wait_s"] == 0
        assert saved["slurm"]["prolog"] == "#!/bin/bash\necho prolog"

        # The fleet page (organization admins): the hosts and their nodes.
        page.click("#fleet-link")
        expect(page.locator("#hosts tbody tr")).not_to_have_count(0)
        expect(page.locator("#hosts")).to_contain_text("web1/")
        expect(page.locator("#usage")).to_contain_text("default")

        # The overview lists it, with its GPUs.
        page.goto(f"{server.url}/")
        row = page.locator('#clusters tr[data-cluster="web1"]')
        expect(row.locator("td.gpus")).to_have_text("24 / 24")
        shots = os.environ.get("GPUCLUSTERS_SCREENSHOTS")
        if shots:
            Path(shots).mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(Path(shots) / "console-overview.png"), full_page=True)

    # An editor sees the cluster but no scale or delete, and a forged delete
    # (with the editor's own valid session and CSRF token) is refused.
    with server.client() as api:
        eve = api.post("/v1/api-keys", json={"user": "eve", "project": "default",
                                             "role": "editor"}).json()["key"]  # fmt: skip
    editor = browser.new_context().new_page()
    with screenshot_on_failure(editor, tmp_path / "editor.png"):
        sign_in(editor, server.url, eve)
        expect(editor.locator('#clusters tr[data-cluster="web1"]')).to_have_count(1)
        assert editor.locator("#new-cluster-default").count() == 0
        editor.goto(f"{server.url}/projects/default/clusters/web1")
        expect(editor.locator("#cluster h1")).to_contain_text("web1")
        assert editor.locator("#delete-button").count() == 0
        assert editor.locator("#scale").count() == 0
        assert editor.locator("#configure").count() == 0
        assert editor.locator("#fleet-link").count() == 0
        assert editor.request.get(f"{server.url}/fleet").status == 403
        headers = editor.locator("body").get_attribute("hx-headers") or ""
        csrf = re.search(r'"X-CSRF-Token": "([^"]+)"', headers)
        assert csrf, headers
        forged = editor.request.post(
            f"{server.url}/projects/default/clusters/web1/delete",
            form={"csrf_token": csrf.group(1), "volume": "delete"},
            max_redirects=0,
        )
        assert forged.status == 403, forged.text()
        assert forged.json()["code"] == "forbidden"
        # Without the CSRF token, not even the admin's session may act.
        no_token = page.request.post(
            f"{server.url}/projects/default/clusters/web1/delete", form={"volume": "delete"},
            max_redirects=0,
        )  # fmt: skip
        assert no_token.status == 403
    with server.client() as api:
        assert api.get("/v1/projects/default/clusters/web1").json()["status"] == "ready"

    with screenshot_on_failure(page, tmp_path / "delete.png"):
        # Delete, keeping the volume: the page follows it until it is gone.
        page.goto(f"{server.url}/projects/default/clusters/web1")
        volume = page.locator("#delete strong").inner_text()
        expect(page.locator('#delete input[value="keep"]')).to_be_checked()
        page.click("#delete-button")
        page.wait_for_url(f"{server.url}/", timeout=60_000)
        with server.client() as api:
            assert api.get("/v1/projects/default/clusters/web1").status_code == 404
            kept = [v["name"] for v in api.get("/v1/projects/default/volumes").json()]
        assert volume in kept

        # Sign out: the session is gone, pages need a new sign-in.
        page.click("#sign-out")
        expect(page).to_have_url(f"{server.url}/login")
        page.goto(f"{server.url}/")
        expect(page).to_have_url(f"{server.url}/login")


def test_node_page_on_the_embedded_fleet(
    server_factory: Servers, browser: playwright_api.Browser, tmp_path: Path
) -> None:
    """The issue's acceptance on real nodes: open a node, see its GPU charts
    fill from the agent's heartbeats, run a health check and see its
    result, inject a fault from the CLI, approve the repair in the browser,
    and watch the page follow the repair until the node runs again."""
    expect = playwright_api.expect
    if os.geteuid() != 0:
        pytest.skip("the embedded fleet needs root")
    server = server_factory(provider="netns", start=False)
    server.env["GPUCLUSTERS_REPAIR_COOLDOWN_S"] = "0"
    server.start()
    out = server.cli("clusters", "create", "c1", "--type", "slurm", "--gpus", "16", "--wait",
                     "--output", "json", timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    victim = sorted(n["name"] for n in json.loads(out.stdout)["nodes"])[0]
    assert server.cli("clusters", "configure", "c1", "--repair-max-wait", "0").returncode == 0

    page = browser.new_page()
    with screenshot_on_failure(page, tmp_path / "node.png"):
        sign_in(page, server.url, server.api_key)
        page.goto(f"{server.url}/projects/default/nodes/{victim}")
        expect(page.locator("#node h1 .status")).to_have_text("running")
        # The charts: 8 GPUs, points added as heartbeats arrive (every 5 s).
        expect(page.locator("#charts")).to_have_attribute("data-gpus", "8", timeout=30_000)
        expect(page.locator('.chart[data-metric="temperature_c"] canvas')).to_have_count(1)
        expect(page.locator('.chart[data-metric="utilization_pct"]')).to_have_attribute(
            "data-points", re.compile(r"^([2-9]|\d\d+)$"), timeout=30_000
        )
        page.evaluate("window.__stillTheSamePage = true")
        # Its cluster's kubeconfig, downloaded as a file.
        page.goto(f"{server.url}/projects/default/clusters/c1")
        with page.expect_download() as download:
            page.click("#kubeconfig button")
        kubeconfig = Path(download.value.path()).read_text()
        assert "current-context:" in kubeconfig
        # No credential in it: kubectl asks the CLI for a token at each run.
        (user,) = yaml.safe_load(kubeconfig)["users"]
        assert user["user"]["exec"]["command"] == "gpuclusters"
        assert user["user"]["exec"]["args"][:3] == ["clusters", "token", "c1"]
        assert "client-key-data" not in kubeconfig
        page.goto(f"{server.url}/projects/default/nodes/{victim}")
        page.evaluate("window.__stillTheSamePage = true")

        # A health check from the page; its result shows up by itself.
        page.select_option("#check", "host-device")
        page.fill("#duration_s", "5")
        page.click("#run-check button[type=submit]")
        page.evaluate("window.__stillTheSamePage = true")
        run = page.locator('#runs tr[data-check="host-device"]').first
        expect(run.locator(".status")).to_have_text(
            re.compile("^(passed|failed|skipped)$"), timeout=90_000
        )

        # A fault from the CLI: the repair appears, pending approval.
        r = server.cli("nodes", "inject-fault", victim, "--kind", "xid", "--code", "79",
                       "--gpu", "3")  # fmt: skip
        assert r.returncode == 0, r.stderr
        pending = page.locator('#repairs tr[data-state="pending_approval"]')
        expect(pending).to_have_count(1, timeout=60_000)
        assert page.evaluate("window.__stillTheSamePage") is True
        expect(page.locator("#alerts tr.open")).not_to_have_count(0)
        pending.locator("button.approve").click()
        # The page follows the migration to its end without a reload.
        page.evaluate("window.__stillTheSamePage = true")
        expect(page.locator('#repairs tr[data-state="succeeded"]')).to_have_count(
            1, timeout=240_000
        )
        expect(page.locator("#node h1 .status")).to_have_text("running", timeout=60_000)
        assert page.evaluate("window.__stillTheSamePage") is True
    assert server.cli("clusters", "delete", "c1", "--wait").returncode == 0
