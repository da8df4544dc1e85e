"""The system image catalog (imagebuild/catalog) and the umoci assembly
it uses (imagebuild/umoci, the real umoci): archives are
self-consistent OCI layouts (digests, sizes, diff_ids of the gzip layers),
deterministic, cached by their inputs' hash; the Go tools' images put the
binary where the upstream manifests expect it; the Debian layer's pipeline
drops /dev and fails cleanly (a fake mmdebstrap, no network)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil
import stat
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import IO, Any

import pytest

from gpuclusters.imagebuild import catalog as ic
from gpuclusters.imagebuild import umoci
from gpuclusters.layers.kubernetes import images
from gpuclusters.layers.kubernetes.config import K8S_VERSION
from gpuclusters.layers.kubernetes.images import CONFIG_MEDIA, MANIFEST_MEDIA, ImageBuildError

LAYER_GZIP_MEDIA = "application/vnd.oci.image.layer.v1.tar+gzip"

# --- helpers ----------------------------------------------------------------------------------


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _tar(entries: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in entries.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _archive_files(path: Path) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    with tarfile.open(path) as tar:
        for member in tar.getmembers():
            if member.isfile():
                f = tar.extractfile(member)
                assert f is not None
                out[member.name] = f.read()
    return out


def _blob(files: dict[str, bytes], digest: str) -> bytes:
    algo, hexdigest = digest.split(":", 1)
    assert algo == "sha256"
    return files[f"blobs/sha256/{hexdigest}"]


def _check_layout(path: Path) -> tuple[dict[str, Any], dict[str, Any], list[bytes]]:
    """Assert that the archive at ``path`` is a consistent OCI image layout
    with one image; return its index entry, config and uncompressed layers."""
    files = _archive_files(path)
    assert json.loads(files["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    for name, data in files.items():
        if name.startswith("blobs/sha256/"):
            assert hashlib.sha256(data).hexdigest() == name.rsplit("/", 1)[1]
    [desc] = json.loads(files["index.json"])["manifests"]
    assert desc["mediaType"] == MANIFEST_MEDIA
    manifest_blob = _blob(files, desc["digest"])
    assert desc["size"] == len(manifest_blob)
    manifest = json.loads(manifest_blob)
    assert manifest["config"]["mediaType"] == CONFIG_MEDIA
    config_blob = _blob(files, manifest["config"]["digest"])
    assert manifest["config"]["size"] == len(config_blob)
    config = json.loads(config_blob)
    layers = []
    for layer_desc, diff_id in zip(manifest["layers"], config["rootfs"]["diff_ids"], strict=True):
        assert layer_desc["mediaType"] == LAYER_GZIP_MEDIA
        blob = _blob(files, layer_desc["digest"])
        assert layer_desc["size"] == len(blob)
        plain = gzip.decompress(blob)
        assert _sha(plain) == diff_id
        layers.append(plain)
    assert len(config["history"]) == len(layers)
    return desc, config, layers


def _members(layer: bytes) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        return {m.name: m for m in tar.getmembers()}


def _content(layer: bytes, name: str) -> bytes:
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        f = tar.extractfile(name)
        assert f is not None
        return f.read()


# --- the archive, assembled by umoci ----------------------------------------------------------


def _source(data: bytes) -> umoci.TarSource:
    def write(out: IO[bytes]) -> None:
        # In pieces, as a root filesystem streams from mmdebstrap.
        for i in range(0, len(data), 4096):
            out.write(data[i : i + 4096])

    return write


def test_umoci_archive_multi_layer(tmp_path: Path) -> None:
    bottom, top = _tar({"etc/os": b"debian", "big": b"a" * 100_000}), _tar({"app": b"binary"})
    dest = tmp_path / "out" / "img.tar"
    dest.parent.mkdir()
    config = umoci.ImageConfig(entrypoint=("/app",), user="65532:65532", env=("A=1", "B=2"))

    def build(work: str) -> umoci.Packed:
        (tmp_path / work).mkdir()
        layers = [(_source(bottom), "root"), (_source(top), "app")]
        return umoci.build_archive(dest, "v1", layers, config, tmp_path / work)

    packed = build("w1")
    desc, image_config, layers = _check_layout(dest)
    assert desc["digest"] == packed.manifest_digest
    assert desc["annotations"] == {"org.opencontainers.image.ref.name": "v1"}
    assert image_config["config"] == {
        "Entrypoint": ["/app"],
        "User": "65532:65532",
        "Env": ["A=1", "B=2"],
    }
    assert (image_config["architecture"], image_config["os"]) == ("amd64", "linux")
    assert image_config["rootfs"]["diff_ids"] == [_sha(bottom), _sha(top)]
    assert [d.diff_id for d in packed.layers] == [_sha(bottom), _sha(top)]
    assert [h["created_by"] for h in image_config["history"]] == ["root", "app"]
    assert layers == [bottom, top]
    # Deterministic: the same layers give the same bytes, owners root, mtime 0.
    first = dest.read_bytes()
    assert build("w2") == packed
    assert dest.read_bytes() == first
    with tarfile.open(dest) as tar:
        for m in tar.getmembers():
            assert (m.uid, m.gid, m.mtime) == (0, 0, 0)
    # Nothing left beside it.
    assert [p.name for p in dest.parent.iterdir()] == ["img.tar"]


def test_umoci_archive_one_blob_per_distinct_layer(tmp_path: Path) -> None:
    layer = _tar({"x": b"y"})
    dest = tmp_path / "img.tar"
    umoci.build_archive(
        dest, "1", [(_source(layer), "a"), (_source(layer), "b")], umoci.ImageConfig(), tmp_path
    )
    blobs = [n for n in _archive_files(dest) if n.startswith("blobs/")]
    assert len(blobs) == 3  # config, manifest, the layer once
    _check_layout(dest)


def test_umoci_archive_failures_leave_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dest = tmp_path / "out" / "img.tar"
    dest.parent.mkdir()
    with pytest.raises(ImageBuildError, match="at least one layer"):
        umoci.build_archive(dest, "1", [], umoci.ImageConfig(), tmp_path / "w0")

    def failing(out: IO[bytes]) -> None:
        out.write(_tar({"x": b"y"})[:1024])
        raise ImageBuildError("mmdebstrap failed (exit 1)")

    (tmp_path / "w1").mkdir()
    with pytest.raises(ImageBuildError, match="mmdebstrap failed"):
        umoci.build_archive(dest, "1", [(failing, "root")], umoci.ImageConfig(), tmp_path / "w1")
    # A tag umoci refuses: its own message.
    (tmp_path / "w2").mkdir()
    with pytest.raises(ImageBuildError, match="umoci new failed"):
        umoci.build_archive(
            dest, "bad tag", [(_source(_tar({})), "x")], umoci.ImageConfig(), tmp_path / "w2"
        )
    assert list(dest.parent.iterdir()) == []
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(umoci.UmociMissingError, match="apt-get install umoci"):
        umoci.build_archive(dest, "1", [(_source(b""), "x")], umoci.ImageConfig(), tmp_path / "w3")


# --- files layers and static images -----------------------------------------------------------


def _binary(tmp_path: Path, name: str = "tool", content: bytes = b"\x7fELF dummy") -> ic.HostFile:
    path = tmp_path / name
    path.write_bytes(content)
    return ic.HostFile("/manager", (path,), mode=0o755)


def test_files_layer_parents_owners_and_order(tmp_path: Path) -> None:
    layer = ic.FilesLayer(
        files=(
            ic.InlineFile("/home/u/.rc", b"x", 0o600, 1000, 1000),
            _binary(tmp_path),
        ),
        dirs=(ic.Dir("/home/u", 0o700, 1000, 1000), ic.Dir("/tmp", 0o1777)),
        symlinks=(("/usr/bin/tool", "/manager"),),
    ).tar()
    members = _members(layer)
    names = list(members)
    assert names == [
        "home",
        "home/u",
        "tmp",
        "usr",
        "usr/bin",
        "home/u/.rc",
        "manager",
        "usr/bin/tool",
    ]
    assert (members["home/u"].uid, stat.S_IMODE(members["home/u"].mode)) == (1000, 0o700)
    assert members["home/u/.rc"].uid == 1000 and members["home/u/.rc"].uname == ""
    assert stat.S_IMODE(members["tmp"].mode) == 0o1777
    assert stat.S_IMODE(members["manager"].mode) == 0o755
    assert members["usr/bin/tool"].issym()


def test_files_layer_rejects_relative_and_escaping_paths() -> None:
    for dest in ("etc/passwd", "/", "/a/../b"):
        with pytest.raises(ImageBuildError):
            ic.FilesLayer(files=(ic.InlineFile(dest, b""),)).tar()


def test_static_image_is_distroless_like(tmp_path: Path) -> None:
    recipe = ic.static_image("demo", "v1", _binary(tmp_path), entrypoint=("/manager",))
    cache = tmp_path / "cache"
    assert ic.build_image(recipe, cache) == "built"
    _, config, [layer] = _check_layout(recipe.archive(cache))
    assert config["config"] == {
        "Entrypoint": ["/manager"],
        "Env": [images.PATH_ENV],
        "User": "65532:65532",
        "WorkingDir": "/",
    }
    members = _members(layer)
    assert _content(layer, "manager") == b"\x7fELF dummy"
    assert stat.S_IMODE(members["manager"].mode) == 0o755
    assert b"nonroot:x:65532:65532:" in _content(layer, "etc/passwd")
    assert b"nonroot:x:65532:" in _content(layer, "etc/group")
    assert stat.S_IMODE(members["tmp"].mode) == 0o1777
    assert members["home/nonroot"].uid == 65532
    assert members["etc/ssl/certs/ca-certificates.crt"].isfile()


# --- caching ----------------------------------------------------------------------------------


def test_build_is_skipped_until_an_input_changes(tmp_path: Path) -> None:
    binary = _binary(tmp_path)
    recipe = ic.static_image("demo", "v1", binary, entrypoint=("/manager",))
    cache = tmp_path / "cache"
    assert ic.build_image(recipe, cache) == "built"
    stamp = json.loads(recipe.stamp(cache).read_text())
    assert stamp["inputs"] == recipe.inputs_hash()
    assert stamp["ref"] == "gpuclusters.io/demo:v1"
    assert ic.state(recipe, cache).status == "up-to-date"
    assert ic.build_image(recipe, cache) == "up-to-date"
    assert ic.build_image(recipe, cache, force=True) == "built"

    # A new binary: stale, rebuilt, and the archive holds the new one.
    binary.candidates[0].write_bytes(b"\x7fELF dummy v2")
    assert ic.state(recipe, cache).status == "stale"
    assert ic.build_image(recipe, cache) == "built"
    _, _, [layer] = _check_layout(recipe.archive(cache))
    assert _content(layer, "manager") == b"\x7fELF dummy v2"

    # A changed config is an input too.
    retagged = ic.static_image("demo", "v1", binary, entrypoint=("/manager", "--x"))
    assert ic.state(retagged, cache).status == "stale"

    # An archive that is not the one the stamp describes is rebuilt.
    with recipe.archive(cache).open("ab") as f:
        f.write(b"\0" * 512)
    assert ic.state(recipe, cache).status == "stale"
    assert ic.build_image(recipe, cache) == "built"
    # No scratch directories left behind.
    assert not list(cache.glob(".work-*"))


def test_missing_inputs(tmp_path: Path) -> None:
    ready = tmp_path / ".tool-v1.complete"
    binary = ic.HostFile("/tool", (tmp_path / "tool",), ready=ready, hint="build it")
    recipe = ic.static_image("demo", "v1", binary, entrypoint=("/tool",))
    with pytest.raises(ic.MissingInputError, match=r"\.tool-v1\.complete is missing \(build it\)"):
        ic.build_image(recipe, tmp_path / "cache")
    # The binary without its stamp is not ready either (it may be half written).
    (tmp_path / "tool").write_bytes(b"x")
    with pytest.raises(ic.MissingInputError):
        recipe.inputs_hash()
    ready.write_text("v1\n")
    assert ic.build_image(recipe, tmp_path / "cache") == "built"
    # Once built, a vanished input leaves the archive usable.
    (tmp_path / "tool").unlink()
    st = ic.state(recipe, tmp_path / "cache")
    assert (st.status, st.present) == ("up-to-date", True)
    assert st.missing_input is not None and "none of" in st.missing_input


def test_host_file_candidates_in_order(tmp_path: Path) -> None:
    second = tmp_path / "b"
    second.write_text("b")
    f = ic.HostFile("/x", (tmp_path / "a", second))
    assert f.source() == second
    (tmp_path / "a").write_text("a")
    assert f.source() == tmp_path / "a"


# --- the catalog ------------------------------------------------------------------------------


def _sources(tmp_path: Path) -> ic.Sources:
    return ic.Sources(
        addons=tmp_path / "addons",
        k8s_bin=tmp_path / "k8s",
        k8s_ready=None,
        gomodcache=tmp_path / "gomod",
    )


def test_catalog_entries_match_the_upstream_images(tmp_path: Path) -> None:
    recipes = ic.catalog(_sources(tmp_path))
    assert set(recipes) >= {
        "pause",
        "base",
        "kueue",
        "mpi-operator",
        "vc-scheduler",
        "vc-controller-manager",
        "vc-webhook-manager",
        "mpi",
        "torch",
    }
    expected = {
        # name: (tag, entrypoint, user)
        "kueue": ("v0.17.0", ["/manager"], "65532:65532"),
        "mpi-operator": ("v0.8.0", ["/opt/mpi-operator"], None),
        "vc-scheduler": ("v1.14.1", ["/vc-scheduler"], None),
        "vc-controller-manager": ("v1.14.1", ["/vc-controller-manager"], None),
        "vc-webhook-manager": ("v1.14.1", ["/vc-webhook-manager"], None),
        "pause": (f"v{K8S_VERSION}", ["/pause"], "65535:65535"),
    }
    for name, (tag, entrypoint, user) in expected.items():
        recipe = recipes[name]
        config = recipe.image_config()
        assert recipe.tag == tag
        assert recipe.ref == f"gpuclusters.io/{name}:{tag}"
        assert config["Entrypoint"] == entrypoint
        assert config.get("User") == user
    assert recipes["mpi-operator"].image_config()["Cmd"] == ["--help"]
    # The entrypoint of each Go tool is the binary the recipe puts in.
    for name in ("kueue", "mpi-operator", "vc-scheduler", "vc-controller-manager"):
        recipe = recipes[name]
        [layer] = recipe.layers
        assert isinstance(layer, ic.FilesLayer)
        binaries = [f for f in layer.files if f.mode == 0o755]
        assert [f.dest for f in binaries] == list(recipe.entrypoint[:1])
    # The webhook image: a Debian layer, then the binary, the certificate
    # script (run as ./gen-admission-secret.sh from /) and kubectl.
    webhook = recipes["vc-webhook-manager"]
    debian, extra = webhook.layers
    assert isinstance(debian, ic.DebianLayer) and isinstance(extra, ic.FilesLayer)
    assert {"openssl", "ca-certificates"} <= set(debian.packages)
    assert sorted(f.dest for f in extra.files) == [
        "/gen-admission-secret.sh",
        "/usr/local/bin/kubectl",
        "/vc-webhook-manager",
    ]
    assert webhook.workdir == "/"
    # MPI: upstream's mpiuser and sshd configuration.
    mpi = recipes["mpi"]
    [mpi_layer] = mpi.layers
    assert isinstance(mpi_layer, ic.DebianLayer)
    assert {"openmpi-bin", "openssh-server", "openssh-client"} <= set(mpi_layer.packages)
    assert mpi.workdir == "/home/mpiuser"
    user_conf = next(f for f in mpi_layer.files if f.dest == "/home/mpiuser/.sshd_config")
    assert (user_conf.uid, user_conf.gid) == (1000, 1000)
    assert b"Port 2222" in user_conf.data()
    torch = recipes["torch"]
    [torch_layer] = torch.layers
    assert isinstance(torch_layer, ic.DebianLayer)
    assert "python3-torch" in torch_layer.packages
    assert any("is_gloo_available" in c for c in torch_layer.checks)
    # SkyPilot's pod: its bootstrap finds every tool it would apt-get,
    # curl or pip install (so nothing is fetched at launch), runs as root.
    sky = recipes["skypilot"]
    [sky_layer] = sky.layers
    assert isinstance(sky_layer, ic.DebianLayer)
    assert {"rsync", "curl", "wget", "netcat-openbsd", "gcc", "patch", "pciutils",
            "openssh-server", "sudo", "procps"} <= set(sky_layer.packages)  # fmt: skip
    config = sky.image_config()
    assert config.get("User") is None and config["WorkingDir"] == "/root"
    assert {"HOME=/root", "UV_OFFLINE=1"} <= set(config["Env"])
    assert any("skypilot[kubernetes,remote]==" in h and "--no-index" in h for h in sky_layer.hooks)
    assert any("import sky, ray" in c for c in sky_layer.checks)


def test_catalog_rejects_bad_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def recipes(_src: ic.Sources | None = None) -> list[ic.ImageRecipe]:
        return [ic.ImageRecipe("my_tool", "v1", ())]

    monkeypatch.setattr(ic, "default_recipes", recipes)
    with pytest.raises(ImageBuildError, match="bad image name"):
        ic.catalog(_sources(tmp_path))

    def twice(_src: ic.Sources | None = None) -> list[ic.ImageRecipe]:
        return [ic.ImageRecipe("tool", "v1", ()), ic.ImageRecipe("tool", "v2", ())]

    monkeypatch.setattr(ic, "default_recipes", twice)
    with pytest.raises(ImageBuildError, match="two recipes"):
        ic.catalog(_sources(tmp_path))


def test_go_tool_recipes_wait_for_the_addon_stamp(tmp_path: Path) -> None:
    src = _sources(tmp_path)
    kueue = ic.catalog(src)["kueue"]
    (src.addons / "bin").mkdir(parents=True)
    (src.addons / "bin" / "kueue").write_bytes(b"\x7fELF kueue")
    with pytest.raises(ic.MissingInputError, match="build-k8s-addons kueue"):
        kueue.inputs_hash()
    (src.addons / ".kueue-v0.17.0.complete").write_text("v0.17.0\n")
    assert ic.build_image(kueue, tmp_path / "cache") == "built"
    _, _, [layer] = _check_layout(kueue.archive(tmp_path / "cache"))
    assert _content(layer, "manager") == b"\x7fELF kueue"


def test_webhook_script_from_the_module_cache(tmp_path: Path) -> None:
    src = _sources(tmp_path)
    webhook = ic.catalog(src)["vc-webhook-manager"]
    _, extra = webhook.layers
    assert isinstance(extra, ic.FilesLayer)
    script = next(f for f in extra.files if f.dest == "/gen-admission-secret.sh")
    assert isinstance(script, ic.HostFile)
    path = (
        src.gomodcache
        / "volcano.sh/volcano@v1.14.1/installer/dockerfile/webhook-manager/gen-admission-secret.sh"
    )
    path.parent.mkdir(parents=True)
    path.write_text("#!/bin/sh\n")
    assert script.source() == path
    assert script.mode == 0o755


# --- the Debian layer (a fake mmdebstrap) -----------------------------------------------------


def test_debian_command_order_and_filters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ic.DEBIAN_MIRROR_ENV, "http://mirror.example/debian")
    layer = ic.DebianLayer(
        ("openssl", "bash"),
        variant="essential",
        hooks=("echo hook",),
        files=(ic.InlineFile("/etc/x.conf", b"x\n", 0o600, 1000, 1000),),
        checks=("openssl version",),
    )
    cmd = layer.command(tmp_path)
    assert cmd[0] == "mmdebstrap"
    assert "--variant=essential" in cmd and "--include=openssl,bash" in cmd
    assert "--dpkgopt=path-exclude=/usr/share/doc/*" in cmd
    assert "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr" in cmd
    hooks = [c.split("=", 1)[1] for c in cmd if c.startswith("--customize-hook=")]
    assert hooks[0] == ic.CLEANUP_HOOK
    assert hooks[1] == "echo hook"
    assert hooks[2].startswith("install -D -m 600 -o 1000 -g 1000 ") and hooks[2].endswith(
        '"$1"/etc/x.conf'
    )
    assert (tmp_path / "file-0").read_bytes() == b"x\n"
    assert hooks[3].startswith('chroot "$1" ') and "'openssl version'" in hooks[3]
    # Suite, the tar on stdout, then the mirrors.
    i = cmd.index("-")
    assert cmd[i - 1] == "bookworm"
    assert cmd[i + 1] == "deb http://mirror.example/debian bookworm main"
    assert len(cmd[i + 1 :]) == 3


def _fake_mmdebstrap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exit_code: int = 0) -> Path:
    """An mmdebstrap that writes a small root filesystem tar to stdout, with
    device nodes and a hard link like the real one's, and records its
    arguments."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "mmdebstrap"
    script.write_text(
        f"""#!{sys.executable}
import io, json, sys, tarfile
json.dump(sys.argv[1:], open({str(tmp_path / "args.json")!r}, "w"))
out = tarfile.open(fileobj=sys.stdout.buffer, mode="w|")
def add(name, kind=tarfile.REGTYPE, data=b"", **kw):
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    for k, v in kw.items():
        setattr(info, k, v)
    out.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
add("./dev/", tarfile.DIRTYPE, mode=0o755)
add("./dev/null", tarfile.CHRTYPE, devmajor=1, devminor=3, mode=0o666)
add("./", tarfile.DIRTYPE, mode=0o755)
add("./usr/bin/python3.11", data=b"py" * 1000, mode=0o755)
add("./usr/bin/python3", tarfile.SYMTYPE, linkname="python3.11")
add("./usr/bin/hard", tarfile.LNKTYPE, linkname="./usr/bin/python3.11")
add("./home/mpiuser/.sshd_config", data=b"Port 2222\\n", uid=1000, gid=1000)
out.close()
sys.exit({exit_code})
"""
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin")
    monkeypatch.setattr("os.geteuid", lambda: 0)
    return tmp_path / "args.json"


def test_debian_layer_pipeline_drops_dev(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args_file = _fake_mmdebstrap(tmp_path, monkeypatch)
    recipe = ic.debian_image(
        "demo",
        "bookworm",
        ("python3",),
        extra_files=(_binary(tmp_path, "app"),),
        cmd=("python3",),
    )
    cache = tmp_path / "cache"
    assert ic.build_image(recipe, cache) == "built"
    _, config, [root, extra] = _check_layout(recipe.archive(cache))
    members = _members(root)
    assert "./dev/null" not in members and "./dev/" not in members
    assert members["./usr/bin/hard"].islnk()
    assert members["./usr/bin/python3"].linkname == "python3.11"
    assert members["./home/mpiuser/.sshd_config"].uid == 1000
    assert _content(root, "./usr/bin/python3.11") == b"py" * 1000
    assert "manager" in _members(extra)
    assert config["config"]["Cmd"] == ["python3"]
    assert "--include=python3" in json.loads(args_file.read_text())


def test_debian_layer_failure_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_mmdebstrap(tmp_path, monkeypatch, exit_code=3)
    recipe = ic.debian_image("demo", "bookworm", ("python3",))
    cache = tmp_path / "cache"
    with pytest.raises(ImageBuildError, match="exit 3"):
        ic.build_image(recipe, cache)
    assert sorted(p.name for p in cache.iterdir()) == []


def test_debian_layer_needs_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    with pytest.raises(ImageBuildError, match="root"):
        ic.DebianLayer(("bash",)).write_tar(io.BytesIO(), tmp_path)


# --- the command line -------------------------------------------------------------------------


@pytest.fixture
def small_catalog(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The real catalog's kueue recipe with a dummy binary, and nothing else."""
    src = _sources(tmp_path)
    (src.addons / "bin").mkdir(parents=True)
    (src.addons / "bin" / "kueue").write_bytes(b"\x7fELF kueue")
    real = ic.default_recipes

    def recipes(_src: ic.Sources | None = None) -> list[ic.ImageRecipe]:
        return [r for r in real(src) if r.name in ("kueue", "mpi-operator")]

    monkeypatch.setattr(ic, "default_recipes", recipes)
    monkeypatch.setenv(ic.CACHE_ENV, str(tmp_path / "cache"))
    return src.addons


def test_cli_build_list_check(
    small_catalog: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = tmp_path / "cache"
    assert ic.main(["build", "kueue"]) == 1  # its stamp is missing
    (small_catalog / ".kueue-v0.17.0.complete").write_text("v0.17.0\n")
    assert ic.main(["check", "kueue"]) == 1
    assert ic.main(["build", "gpuclusters.io/kueue:v0.17.0"]) == 0
    assert ic.main(["check", "kueue:v0.17.0"]) == 0
    capsys.readouterr()
    assert ic.main(["list", "--output", "json"]) == 0
    listed = {e["name"]: e for e in json.loads(capsys.readouterr().out)}
    kueue = listed["kueue"]
    assert kueue["present"] and kueue["status"] == "up-to-date"
    assert kueue["archive"] == str(cache / "kueue_v0.17.0.tar")
    assert kueue["ref"] == "gpuclusters.io/kueue:v0.17.0"
    assert kueue["manifest_digest"].startswith("sha256:")
    op = listed["mpi-operator"]
    assert (op["present"], op["status"], op["inputs_ready"]) == (False, "missing", False)
    assert "build-k8s-addons mpi-operator" in op["missing_input"]
    # A second build only checks.
    assert ic.main(["build", "kueue"]) == 0
    assert "up to date" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ic.main(["build", "kueue:v9"])


@pytest.mark.skipif(shutil.which("skopeo") is None, reason="skopeo is not installed")
def test_skopeo_reads_the_archive(tmp_path: Path) -> None:
    recipe = ic.static_image(
        "demo", "v1", _binary(tmp_path), entrypoint=("/manager",), cmd=("--help",)
    )
    ic.build_image(recipe, tmp_path / "cache")
    out = subprocess.run(
        ["skopeo", "inspect", "--config", f"oci-archive:{recipe.archive(tmp_path / 'cache')}"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    config = json.loads(out)
    assert config["config"]["Entrypoint"] == ["/manager"]
    assert config["config"]["Cmd"] == ["--help"]


def test_cleanup_hook_on_a_root_filesystem(tmp_path: Path) -> None:
    root = tmp_path / "root"
    keep = [
        "run/lock/.keep",
        "etc/passwd",
        "var/lib/apt/lists/partial/.keep-dir",
        "var/cache/apt/archives/partial/.keep-dir",
    ]
    drop = [
        "etc/resolv.conf",
        "etc/hostname",
        "var/cache/ldconfig/aux-cache",
        "var/lib/dpkg/status-old",
        "var/cache/apt/pkgcache.bin",
        "var/lib/apt/lists/deb.debian.org_Packages",
        "var/cache/apt/archives/bash.deb",
        "var/log/dpkg.log",
        "run/mount/utab",
        "tmp/x",
    ]
    for name in keep + drop:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        if not name.endswith(".keep-dir"):
            (root / name).write_text("x")
    subprocess.run(["sh", "-ec", ic.CLEANUP_HOOK, "hook", str(root)], check=True, timeout=30)
    for name in drop:
        assert not (root / name).exists(), name
    for name in keep:
        assert (root / name).parent.is_dir(), name
    assert (root / "run/lock/.keep").exists() and (root / "etc/passwd").exists()
    assert not (root / "run/mount").exists()


BUGGY_STD = """
import re
from enum import IntFlag

class Std(IntFlag):
    NONE = 0
    OUT = 1
    ERR = 2
    ALL = OUT | ERR

    @classmethod
    def from_str(cls, vm):
        def to_std(v):
            v = int(v)
            for s in Std:
                if s == v:
                    return s
            # return None -> should NEVER reach here since we regex check input

        if re.match(r"^[0-3]$", vm):
            return to_std(vm)
        return {int(i): to_std(v) for i, v in (m.split(":") for m in vm.split(","))}
"""


def test_torch_std_fix(tmp_path: Path) -> None:
    """The patch for torchrun's Std.from_str (Debian 12's PyTorch 1.13 on
    Python 3.11) turns the lookup of every value into a hit, and is a no-op
    on a fixed file."""
    api = tmp_path / "api.py"
    api.write_text(BUGGY_STD)
    fix = ic.TORCH_STD_FIX.replace(repr(ic.TORCH_STD_FILE), repr(str(api)))
    assert fix != ic.TORCH_STD_FIX

    def load() -> Any:
        scope: dict[str, Any] = {}
        exec(compile(api.read_text(), str(api), "exec"), scope)
        return scope["Std"]

    assert load().from_str("0") is None  # Python 3.11's Flag iteration: the bug
    exec(fix, {})
    std = load()
    assert std.from_str("0") is std.NONE
    assert std.from_str("3") is std.ALL
    assert std.from_str("0:3,1:0") == {0: std.ALL, 1: std.NONE}
    patched = api.read_text()
    exec(fix, {})
    assert api.read_text() == patched
    torch = ic.catalog(_sources(tmp_path))["torch"]
    [layer] = torch.layers
    assert isinstance(layer, ic.DebianLayer)
    assert layer.hooks == (ic.TORCH_STD_FIX_HOOK,)
    assert any("torchrun" in c and "nproc_per_node=2" in c for c in layer.checks)
