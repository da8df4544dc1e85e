"""The pure parts of users' access: firewall rules, sshd and PAM files,
host certificates, the access sync's digest, SSH key parsing."""

from __future__ import annotations

import os
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpuclusters.core import sshca
from gpuclusters.layers import ssh as sshd
from gpuclusters.layers.base import ClusterRef, GatewayRef, NodeRef, SshAccess, UnixUser
from gpuclusters.layers.kubernetes import config as k8s
from gpuclusters.linux import firewall
from gpuclusters.server.controllers.access import digest

CLUSTER = "abcdef0123456789"


def rules(*, egress: bool, forwards: tuple[firewall.Forward, ...] = ()) -> firewall.ClusterRules:
    return firewall.ClusterRules(cluster_id=CLUSTER, index=7, egress=egress, forwards=forwards)


def test_cluster_chains_forward_gateway_ports_and_masquerade_only_with_egress() -> None:
    fwd = (
        firewall.Forward(public_port=30001, address="10.231.7.14", port=22),
        firewall.Forward(public_port=30000, address="10.231.7.13", port=6443),
    )
    text = firewall.render(rules(egress=True, forwards=fwd))
    assert "-A GPCN-abcdef01 -p tcp --dport 30001 -j DNAT --to-destination 10.231.7.14:22" in text
    assert "-A GPCN-abcdef01 -p tcp --dport 30000 -j DNAT --to-destination 10.231.7.13:6443" in text
    assert "-A GPCP-abcdef01 ! -o gpcb+ -j MASQUERADE" in text
    # Nothing to other clusters comes before the egress accept.
    lines = text.splitlines()
    drop = lines.index("-A GPCF-abcdef01 -o gpcb+ -j DROP")
    accept = lines.index("-A GPCF-abcdef01 -j ACCEPT")
    assert drop < accept
    # Every chain is declared, so a rewrite empties it first.
    for chain in ("GPCN-abcdef01", "GPCP-abcdef01", "GPCF-abcdef01"):
        assert f":{chain} - [0:0]" in text

    closed = firewall.render(rules(egress=False))
    assert "MASQUERADE" not in closed
    assert "-j ACCEPT" not in closed
    assert "DNAT" not in closed


def test_shared_chains_jump_by_bridge_and_subnet() -> None:
    jumps = firewall.shared_jumps(rules(egress=True))
    assert ("filter", "GPC-FROM-CLUSTERS", ["-i", "gpcbabcdef01", "-g", "GPCF-abcdef01"]) in jumps
    assert ("nat", "GPC-POSTROUTING", ["-s", "10.231.7.0/24", "-j", "GPCP-abcdef01"]) in jumps


def test_fixed_forward_chain_order() -> None:
    """Bridged (own cluster) traffic and replies first, cluster to cluster
    dropped before DNATed connections are accepted, everything else dropped."""
    lines = [line for line in firewall.render_fixed().splitlines() if line.startswith("-A GPC-F")]
    assert lines[0].endswith("--physdev-is-bridged -j ACCEPT")
    assert "RELATED,ESTABLISHED -j ACCEPT" in lines[1]
    cross = lines.index("-A GPC-FORWARD -i gpcb+ -o gpcb+ -j DROP")
    dnat = lines.index("-A GPC-FORWARD -o gpcb+ -m conntrack --ctstate DNAT -j ACCEPT")
    assert lines.index("-A GPC-FORWARD -i gpcb+ -j GPC-FROM-CLUSTERS") < cross < dnat
    assert lines[-1] == "-A GPC-FORWARD -j DROP"


@pytest.mark.skipif(
    subprocess.run(["which", "iptables-restore"], capture_output=True).returncode != 0,
    reason="iptables not installed",
)
def test_rendered_rules_parse_with_iptables_restore() -> None:
    """iptables-restore --test accepts what we render (no kernel change)."""
    fwd = (firewall.Forward(public_port=30001, address="10.231.7.14", port=22),)
    for text in (firewall.render(rules(egress=True, forwards=fwd)), firewall.render_fixed()):
        # --test still needs the chains it jumps to; declare the shared ones.
        if text.startswith("*filter"):
            text = text.replace("*filter\n", "*filter\n:GPC-FROM-CLUSTERS - [0:0]\n", 1)
        done = subprocess.run(
            ["iptables-restore", "--test", "--noflush"],
            input=text,
            capture_output=True,
            text=True,
        )
        if "Permission denied" in done.stderr or "can't initialize" in done.stderr:
            pytest.skip("iptables needs root")
        assert done.returncode == 0, done.stderr


def test_sshd_config_trusts_our_files_only() -> None:
    text = sshd.sshd_config("10.231.7.14")
    assert "ListenAddress 10.231.7.14:22" in text
    assert f"TrustedUserCAKeys {sshd.USER_CA}" in text
    assert f"AuthorizedPrincipalsFile {sshd.PRINCIPALS_DIR}/%u" in text
    assert f"AuthorizedKeysFile {sshd.KEYS_DIR}/%u" in text
    for line in ("PermitRootLogin no", "PasswordAuthentication no", "UsePAM yes"):
        assert line in text
    assert "/etc/ssh/" not in text  # never the host's keys or settings


def test_sshd_accepts_the_rendered_config(tmp_path: Path) -> None:
    if not Path(sshd.SSHD_BIN).exists():
        pytest.skip("openssh-server not installed")
    pair = sshca.new_keypair()
    key = tmp_path / "host_key"
    key.write_text(pair.private_openssh)
    key.chmod(0o600)
    # The certificate's line first: its path starts with the key's.
    conf = sshd.sshd_config("127.0.0.1").replace(f"HostCertificate {sshd.HOST_CERT}\n", "")
    conf = conf.replace(sshd.HOST_KEY, str(key))
    path = tmp_path / "sshd_config"
    path.write_text(conf)
    # sshd -t insists on its privilege separation directory, which only the
    # system's ssh service makes (nodes make their own): a fresh machine has none.
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    done = subprocess.run([sshd.SSHD_BIN, "-t", "-f", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_pam_adopts_on_compute_nodes_only() -> None:
    login = sshd.pam_config(adopt_as=None)
    compute = sshd.pam_config(adopt_as="demo-standard-abcde")
    assert "pam_slurm_adopt" not in login
    assert "pam_slurm_adopt.so action_no_jobs=deny" in compute
    assert "nodename=demo-standard-abcde" in compute  # dynamic nodes are in no slurm.conf
    for text in (login, compute):
        assert "auth       required     pam_deny.so" in text  # keys and certificates only


def test_host_certificate_is_renewed_when_names_ca_or_time_change() -> None:
    ca = sshca.new_keypair()
    other_ca = sshca.new_keypair()
    host = sshca.new_keypair()
    now = datetime.now(UTC)
    names = ["demo-login", "10.231.7.14", "gw.example"]
    cert = sshca.sign_host_key(
        ca_private=ca.private_openssh,
        public_key=host.public_openssh,
        principals=names,
        key_id="host:demo-login:x",
        valid_for=timedelta(days=365),
    )
    ca_public = sshca.public_of(ca.private_openssh)
    assert sshd.cert_is_good(cert, ca_public=ca_public, principals=names, now=now)
    assert not sshd.cert_is_good(cert, ca_public=ca_public, principals=names[:2], now=now)
    assert not sshd.cert_is_good(
        cert, ca_public=sshca.public_of(other_ca.private_openssh), principals=names, now=now
    )
    assert not sshd.cert_is_good(
        cert, ca_public=ca_public, principals=names, now=now + timedelta(days=340)
    )
    user_cert = sshca.sign_user_key(
        ca_private=ca.private_openssh,
        public_key=host.public_openssh,
        principal="demo-login",
        key_id="u",
        valid_for=timedelta(days=365),
    )
    assert not sshd.cert_is_good(user_cert, ca_public=ca_public, principals=["demo-login"], now=now)


def ref(users: tuple[UnixUser, ...], keys: tuple[tuple[str, tuple[str, ...]], ...]) -> ClusterRef:
    return ClusterRef(
        cluster_id=CLUSTER,
        name="demo",
        cluster_type="slurm",
        gpu_type="H100_SXM",
        volume_id=None,
        users=users,
        nodes=(NodeRef(node_id="n1", name="demo-1", host="h1", compute_class="standard"),),
        gateway=GatewayRef(host="gw.example", ssh_port=30001, kubernetes_port=30000),
        ssh=SshAccess(
            user_ca_public_key="ssh-ed25519 CA", host_ca_private_key="x", authorized_keys=keys
        ),
    )


def test_access_digest_changes_with_keys_and_members_only() -> None:
    alice, bob = UnixUser("alice", 10000), UnixUser("bob", 10001)
    base = ref((alice, bob), (("alice", ("ssh-ed25519 A",)), ("bob", ())))
    same = ref((alice, bob), (("alice", ("ssh-ed25519 A",)), ("bob", ())))
    assert digest(base) == digest(same)
    key_gone = ref((alice, bob), (("alice", ()), ("bob", ())))
    member_gone = ref((alice,), (("alice", ("ssh-ed25519 A",)),))
    assert len({digest(base), digest(key_gone), digest(member_gone)}) == 3


def test_gateway_url_brackets_ipv6() -> None:
    assert GatewayRef(host="fd00::2", kubernetes_port=30000).kubernetes_url == (
        "https://[fd00::2]:30000"
    )
    assert GatewayRef(host="gw.example").kubernetes_url is None


def test_pods_are_masqueraded_only_outside_the_pod_network() -> None:
    node = k8s.K8sNode(name="n", address="10.231.7.13", cgroup_root="/gpc-x", labels={})
    assert k8s.pod_egress_rule(node) == [
        "-s", "10.244.13.0/24", "!", "-d", "10.244.0.0/16", "-j", "MASQUERADE",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty"),
        ("ssh-dss AAAAB3NzaC1kc3MAAACBAP", "not accepted"),
        ("-----BEGIN OPENSSH PRIVATE KEY-----", "private key"),
        ("ssh-ed25519 not*base64", "not a valid"),
        ("ssh-ed25519-cert-v01@openssh.com AAAA", "certificate"),
        ("ssh-ed25519", "expected"),
    ],
)
def test_bad_public_keys_are_refused_with_the_reason(text: str, message: str) -> None:
    with pytest.raises(sshca.SshKeyError, match=message):
        sshca.parse_public_key(text)


def test_a_public_key_is_normalised_and_fingerprinted_like_ssh_keygen(tmp_path: Path) -> None:
    pair = sshca.new_keypair("me@laptop")
    parsed = sshca.parse_public_key(pair.public_openssh + "\n")
    assert parsed.comment == "me@laptop"
    assert parsed.openssh == " ".join(pair.public_openssh.split()[:2])
    pub = tmp_path / "k.pub"
    pub.write_text(pair.public_openssh)
    listed = subprocess.run(["ssh-keygen", "-lf", str(pub)], capture_output=True, text=True)
    if listed.returncode == 0:
        assert parsed.fingerprint in listed.stdout


def test_ports_forwarded_by_other_clusters_are_found() -> None:
    listed = "\n".join(
        [
            "-N GPCN-aaaaaaaa",
            "-A GPC-GATEWAY -p tcp -j GPCN-aaaaaaaa",
            "-A GPCN-aaaaaaaa -p tcp -m tcp --dport 30000 -j DNAT --to-destination 10.231.0.1:443",
            "-A GPCN-bbbbbbbb -p tcp -m tcp --dport 30001 -j DNAT --to-destination 10.231.1.14:22",
        ]
    )
    assert firewall.forwarded_ports(listed) == {30000: "GPCN-aaaaaaaa", 30001: "GPCN-bbbbbbbb"}


def test_removed_members_bindings_are_stale() -> None:
    def binding(name: str) -> dict[str, object]:
        return {"metadata": {"name": name}}

    bindings = [
        binding(k8s.user_binding_name("alice")),
        binding(k8s.user_binding_name("carol")),
        binding("gpuclusters-admin"),  # not a user binding of ours: never touched
    ]
    assert k8s.stale_user_bindings(bindings, {"alice"}) == [k8s.user_binding_name("carol")]
    assert k8s.stale_user_bindings(bindings, {"alice", "carol"}) == []
