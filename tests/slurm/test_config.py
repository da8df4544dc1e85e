"""Rendering of Slurm configuration and daemon argv: pure and fast."""

from __future__ import annotations

import pytest

from gpuclusters.core.errors import ValidationError
from gpuclusters.layers.slurm import config as cfg
from gpuclusters.layers.slurm.config import SlurmSpec


def spec(**kw: object) -> SlurmSpec:
    base: dict[str, object] = {
        "cluster_name": "c1",
        "controller_host": "c1-ctl",
        "controller_addr": "10.232.0.10",
    }
    base.update(kw)
    return SlurmSpec(**base)  # type: ignore[arg-type]


def settings(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and " " not in line:
            key, _, value = line.partition("=")
            assert key not in out, f"{key} rendered twice"
            out[key] = value
    return out


def test_slurm_conf_owns_identity_auth_and_defaults() -> None:
    s = settings(cfg.render_slurm_conf(spec()))
    assert s["ClusterName"] == "c1"
    assert s["SlurmctldHost"] == "c1-ctl(10.232.0.10)"
    assert s["SlurmctldParameters"] == "enable_configless"
    assert s["AuthInfo"] == "socket=/run/munge/munge.socket.2"
    assert s["AccountingStoragePass"] == "/run/munge/munge.socket.2"
    assert s["AccountingStorageType"] == "accounting_storage/slurmdbd"
    assert (s["KillWait"], s["MaxArraySize"], s["JobRequeue"]) == ("30", "1000", "1")
    assert s["SchedulerParameters"] == "nohold_on_prolog_fail"
    assert s["ProctrackType"] == "proctrack/linuxproc"
    assert "Prolog" not in s and "Epilog" not in s
    text = cfg.render_slurm_conf(spec())
    assert "NodeSet=gpunodes Feature=gpu\n" in text
    assert "PartitionName=gpu Nodes=gpunodes Default=YES MaxTime=INFINITE State=UP\n" in text


def test_user_lines_replace_defaults_and_add_partitions() -> None:
    extra = (
        "# comment\nkillwait=60\nSchedulerParameters=bf_continue,nohold_on_prolog_fail\n"
        "PartitionName=debug Nodes=gpunodes \\\n  MaxTime=60\nJobAcctGatherFrequency=30\n"
    )
    text = cfg.render_slurm_conf(spec(extra_slurm_conf=extra, partition="batch"))
    s = settings(text)
    assert s["killwait"] == "60" and "KillWait" not in s
    assert s["SchedulerParameters"] == "bf_continue,nohold_on_prolog_fail"
    assert s["JobAcctGatherFrequency"] == "30"
    assert "PartitionName=batch Nodes=gpunodes Default=YES" in text
    assert "PartitionName=debug Nodes=gpunodes MaxTime=60\n" in text


@pytest.mark.parametrize(
    ("line", "named"),
    [
        ("SlurmctldHost=evil", "SlurmctldHost"),
        ("clustername=other", "clustername"),
        ("AuthType=auth/none", "AuthType"),
        ("ProctrackType=proctrack/cgroup", "ProctrackType"),
        ("TaskPlugin=task/cgroup", "TaskPlugin"),
        ("KillWait=10 SelectType=select/linear", "SelectType"),
        ("Prolog=/tmp/x", "Prolog"),
        ("Include /etc/other.conf", "Include"),
        ("NodeName=n1 CPUs=2", "NodeName"),
        ("PartitionName=gpu Nodes=ALL", "gpu"),
        ("NodeSet=gpunodes Feature=x", "gpunodes"),
        ("KillWait=1\nKillWait=2", "KillWait"),
        ("nonsense", "nonsense"),
    ],
)
def test_user_slurm_lines_refused_with_the_key_named(line: str, named: str) -> None:
    with pytest.raises(ValidationError) as err:
        spec(extra_slurm_conf=line)
    assert named in err.value.message
    assert err.value.field == "slurm_conf"


def test_prolog_epilog_paths_and_shebang() -> None:
    s = spec(prolog_script="#!/bin/sh\nexit 0\n", epilog_script="#!/bin/bash\n")
    conf = settings(cfg.render_slurm_conf(s))
    assert conf["Prolog"] == "/etc/slurm/prolog.sh"
    assert conf["Epilog"] == "/etc/slurm/epilog.sh"
    assert cfg.scripts(s) == {
        "/etc/slurm/prolog.sh": "#!/bin/sh\nexit 0\n",
        "/etc/slurm/epilog.sh": "#!/bin/bash\n",
    }
    with pytest.raises(ValidationError) as err:
        spec(prolog_script="exit 0\n")
    assert err.value.field == "prolog"


def test_gres_conf_needs_file_lines() -> None:
    assert cfg.render_gres_conf(spec()).endswith("\nName=gpu File=/dev/nvidia[0-7]\n")
    typed = cfg.render_gres_conf(spec(gpu_type="h100"))
    assert "Name=gpu Type=h100 File=/dev/nvidia[0-7]\n" in typed
    odd = spec(gpus_per_node=2, gpu_devices=("/dev/nvidia0", "/dev/nvidia3"))
    assert "Name=gpu File=/dev/nvidia0\nName=gpu File=/dev/nvidia3\n" in cfg.render_gres_conf(odd)
    with pytest.raises(ValidationError):
        spec(gpus_per_node=8, gpu_devices=("/dev/nvidia0",))
    with pytest.raises(ValidationError, match="Name=gpu"):
        spec(extra_gres_conf="Name=gpu File=/dev/foo")
    assert "Name=mps Count=100\n" in cfg.render_gres_conf(
        spec(extra_gres_conf="Name=mps Count=100")
    )


def test_compress_devices() -> None:
    assert cfg.compress_devices(["/dev/nvidia2", "/dev/nvidia3"]) == ["/dev/nvidia[2-3]"]
    assert cfg.compress_devices(["/dev/a1", "/dev/b2"]) == ["/dev/a1", "/dev/b2"]
    assert cfg.compress_devices(["/dev/x01", "/dev/x02"]) == ["/dev/x01", "/dev/x02"]
    assert cfg.compress_devices(["/dev/nvidia0"]) == ["/dev/nvidia0"]


def test_cgroup_conf() -> None:
    text = cfg.render_cgroup_conf(
        spec(extra_cgroup_conf="ConstrainDevices=yes\nAllowedRAMSpace=90")
    )
    s = settings(text)
    assert s["CgroupPlugin"] == "cgroup/v1"
    assert s["ConstrainDevices"] == "yes" and s["ConstrainCores"] == "no"
    assert s["AllowedRAMSpace"] == "90"
    with pytest.raises(ValidationError, match="CgroupPlugin"):
        spec(extra_cgroup_conf="CgroupPlugin=autodetect")


def test_slurmdbd_conf_and_accounting_off() -> None:
    s = settings(cfg.render_slurmdbd_conf(spec()))
    assert s["StorageType"] == "accounting_storage/mysql"
    assert s["StorageHost"] == "localhost" and s["StorageUser"] == "slurm"
    assert s["AuthInfo"] == "socket=/run/munge/munge.socket.2"
    off = settings(cfg.render_slurm_conf(spec(accounting=False)))
    assert off["AccountingStorageType"] == "accounting_storage/none"
    assert "AccountingStoragePass" not in off and "AccountingStorageTRES" not in off
    assert [d.path for d in cfg.controller_directories(spec(accounting=False))] == [
        "/run/munge",
        "/var/lib/munge",
        "/var/log/munge",
        "/var/spool/slurmctld",
    ]


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"cluster_name": "Bad-Name"}, "cluster_name"),
        ({"cluster_name": "1abc"}, "cluster_name"),
        ({"controller_addr": "ctl.example"}, "controller_addr"),
        ({"controller_host": "bad host"}, "controller_host"),
        ({"partition": "a b"}, "partition"),
        ({"gpu_type": "h 100"}, "gpu_type"),
        ({"max_nodes": 0}, "max_nodes"),
        ({"paths": cfg.SlurmPaths(mysql_run_dir="/run/db")}, "paths"),
    ],
)
def test_spec_validation(kw: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError) as err:
        spec(**kw)
    assert err.value.field == field


def test_slurm_cluster_name() -> None:
    assert cfg.slurm_cluster_name("My-Cluster.1") == "my_cluster_1"
    assert cfg.slurm_cluster_name("9lives") == "c9lives"
    assert len(cfg.slurm_cluster_name("x" * 100)) == 40
    spec(cluster_name=cfg.slurm_cluster_name("Prod GPU #2"))


def test_daemon_argv() -> None:
    s = spec(gpu_type="h100")
    assert cfg.slurmd_argv(s, node_name="c1-n1", features=["standard"]) == [
        "slurmd",
        "-D",
        "-Z",
        "-N",
        "c1-n1",
        "--conf-server",
        "10.232.0.10:6817",
        "--conf",
        "Gres=gpu:h100:8 Feature=gpu,h100,standard",
    ]
    assert cfg.slurmd_argv(spec(), node_name="n")[-1] == "Gres=gpu:8 Feature=gpu"
    with pytest.raises(ValidationError):
        cfg.slurmd_argv(s, node_name="n", features=["a b"])
    with pytest.raises(ValidationError):
        cfg.slurmd_argv(s, node_name="-rf")
    m = cfg.munged_argv(s)
    assert m[:5] == ["setpriv", "--reuid=munge", "--regid=munge", "--init-groups", "munged"]
    assert "--foreground" in m and "--socket=/run/munge/munge.socket.2" in m
    assert cfg.mariadbd_argv(s)[:2] == ["mariadbd", "--no-defaults"]
    assert "--skip-networking" in cfg.mariadbd_argv(s)
    assert cfg.slurmctld_argv(s) == ["slurmctld", "-D"]
    assert cfg.mkdir_argv(cfg.Directory("/run/munge", "munge", 0o755)) == [
        "install",
        "-d",
        "-o",
        "munge",
        "-g",
        "munge",
        "-m",
        "0755",
        "/run/munge",
    ]
