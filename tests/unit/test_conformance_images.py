"""The conformance suite's images (imagebuild/conformance):
their names and tags are the ones the release's e2e.test pulls, and the
stand-ins carry what the specs use (the paths, commands and modes their
Dockerfiles give); the shared command line picks every tag of a name."""

from __future__ import annotations

import io
import json
import re
import shutil
import stat
import tarfile
from pathlib import Path

import pytest

from gpuclusters.imagebuild import catalog as ic
from gpuclusters.imagebuild import conformance as ci
from gpuclusters.layers.kubernetes import images
from gpuclusters.layers.kubernetes.config import K8S_VERSION

REAL_MANIFEST = (
    ic.Sources.from_env().gomodcache
    / f"k8s.io/kubernetes@v{K8S_VERSION}/test/utils/image/manifest.go"
)


def _fake_inputs(tmp_path: Path) -> tuple[ic.Sources, Path]:
    """Every input of every recipe under ``tmp_path``, as small placeholder files."""
    src = ic.Sources(
        addons=tmp_path / "addons",
        k8s_bin=tmp_path / "k8s",
        k8s_ready=None,
        gomodcache=tmp_path / "gomod",
    )
    root = tmp_path / "conformance"
    for recipe in ci.conformance_recipes(src, root):
        for layer in recipe.layers:
            files = getattr(layer, "files", ())
            for f in (*files, *getattr(layer, "inputs", ())):
                # Only the recipe's own inputs, under tmp_path: never a file
                # of this machine (busybox's layer reads /bin/busybox).
                if isinstance(f, ic.HostFile) and f.candidates[0].is_relative_to(tmp_path):
                    path = f.candidates[0]
                    path.parent.mkdir(parents=True, exist_ok=True)
                    if f.dest == "/bin/busybox" and images.BUSYBOX.is_file():
                        # The layer lists its applets by running it.
                        shutil.copy(images.BUSYBOX, path)
                    else:
                        path.write_bytes(f"placeholder for {f.dest}\n".encode())
                    if f.ready is not None:
                        f.ready.parent.mkdir(parents=True, exist_ok=True)
                        f.ready.write_text("stamp\n")
    return src, root


def test_refs_are_the_release_manifests(tmp_path: Path) -> None:
    """Each image is named as the release's test/utils/image/manifest.go
    names it (registry, name, tag), so KUBE_TEST_REPO_LIST is all the
    suite needs to find it."""
    if not REAL_MANIFEST.is_file():
        pytest.skip(f"{REAL_MANIFEST} is not in the Go module cache (scripts/build-k8s)")
    text = REAL_MANIFEST.read_text()
    registries = {"PromoterE2eRegistry": ci.E2E_REGISTRY, "GcRegistry": ci.K8S_REGISTRY,
                  "GcEtcdRegistry": ci.K8S_REGISTRY}  # fmt: skip
    upstream = {
        f"{registries[reg]}/{name}:{tag}"
        for reg, name, tag in re.findall(r'Config\{list\.(\w+), "([^"]+)", "([^"]+)"\}', text)
        if reg in registries
    }
    refs = [r.ref for r in ci.conformance_recipes(*_fake_inputs(tmp_path))]
    assert len(refs) == len(set(refs))
    missing = sorted(set(refs) - upstream)
    assert not missing, f"not images of e2e.test v{K8S_VERSION}: {missing}"
    # The ones the conformance specs pull, at least.
    for needed in ("agnhost", "busybox", "httpd", "nginx", "pause", "etcd", "sample-apiserver"):
        assert any(f"/{needed}:" in r for r in refs), needed


def _config_and_files(archive: Path) -> tuple[dict[str, object], dict[str, tarfile.TarInfo]]:
    """The image config and the entries of every layer of an OCI archive."""
    blobs: dict[str, bytes] = {}
    with tarfile.open(archive) as outer:
        for m in outer.getmembers():
            f = outer.extractfile(m) if m.isfile() else None
            if f is not None:
                blobs[m.name] = f.read()
    index = json.loads(blobs["index.json"])
    manifest = json.loads(blobs["blobs/sha256/" + index["manifests"][0]["digest"][7:]])
    config = json.loads(blobs["blobs/sha256/" + manifest["config"]["digest"][7:]])
    entries: dict[str, tarfile.TarInfo] = {}
    for layer in manifest["layers"]:
        data = blobs["blobs/sha256/" + layer["digest"][7:]]
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as t:
            for m in t.getmembers():
                entries[m.name] = m
    return config["config"], entries


@pytest.mark.skipif(not images.BUSYBOX.is_file(), reason="busybox-static is not installed")
def test_busybox_stand_ins(tmp_path: Path) -> None:
    src, root = _fake_inputs(tmp_path)
    recipes = {f"{r.name}:{r.tag}": r for r in ci.conformance_recipes(src, root)}
    cache = tmp_path / "cache"

    httpd = recipes["httpd:2.4.38-4"]
    ic.build_image(httpd, cache)
    config, files = _config_and_files(httpd.archive(cache))
    assert config["Cmd"] == ["httpd-foreground"]
    assert config["WorkingDir"] == "/usr/local/apache2"
    # The StatefulSet specs probe /index.html here and `mv` it away.
    assert "usr/local/apache2/htdocs/index.html" in files
    assert files["usr/local/bin/httpd-foreground"].mode & 0o111
    assert "bin/mv" in files and "bin/httpd" in files

    nnp = recipes["nonewprivs:1.3"]
    ic.build_image(nnp, cache)
    config, files = _config_and_files(nnp.archive(cache))
    assert config["Cmd"] == ["nnp"]
    assert files["usr/local/bin/nnp"].mode & stat.S_ISUID

    kitten = recipes["kitten:1.7"]
    ic.build_image(kitten, cache)
    config, files = _config_and_files(kitten.archive(cache))
    assert (config["Entrypoint"], config["Cmd"]) == (["/agnhost"], ["test-webserver"])
    assert {"agnhost", "kitten.jpg", "data.json"} <= set(files)


def test_cli_picks_every_tag_of_a_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    src, root = _fake_inputs(tmp_path)
    recipes = ci.conformance_recipes(src, root)
    monkeypatch.setattr(ci, "conformance_recipes", lambda: recipes)
    cache = tmp_path / "cache"
    assert ci.main(["--cache", str(cache), "check", "httpd"]) == 1
    assert "httpd:2.4.38-4: missing" in capsys.readouterr().err
    if images.BUSYBOX.is_file():
        assert (
            ci.main(["--cache", str(cache), "build", "registry.k8s.io/e2e-test-images/httpd"]) == 0
        )
        assert ci.main(["--cache", str(cache), "check", "httpd"]) == 0
        assert sorted(p.name for p in cache.glob("httpd_*.tar")) == [
            "httpd_2.4.38-4.tar",
            "httpd_2.4.39-4.tar",
        ]
        assert ci.main(["--cache", str(cache), "check", "nginx:1.14-4"]) == 1
    with pytest.raises(SystemExit, match="unknown image"):
        ci.main(["--cache", str(cache), "build", "httpd:9"])
