"""The JSON bodies between the server and host agents (both sides import
this module, so the two can never disagree). Bytes travel as base64."""

from __future__ import annotations

import base64

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text.encode(), validate=True)


class Segment(_Body):
    """``PUT /v1/networks/{cluster_id}``: the cluster's network on this host."""

    index: int = Field(ge=0, le=255)
    vni: int = Field(ge=1, le=0xFFFFFF)
    peers: list[str]
    mtu: int = Field(ge=1280, le=9000)
    names: dict[str, str]
    egress: bool = True


class NodeCreate(_Body):
    """``PUT /v1/nodes/{node_id}``: a node of the cluster at ``address``."""

    name: str
    cluster_id: str
    cluster_name: str
    gpu_type: str
    compute_class: str
    address: str
    volume_id: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    # The project's host id block (core/idblocks.py): first host id.
    host_ids_first: int | None = None


class InstanceOut(_Body):
    node_id: str
    host: str
    state: str
    message: str = ""


class ShellInfo(_Body):
    hostname: str
    address: str
    # The host command line that enters the node (for an operator's terminal).
    enter: list[str]
    # The host's Python with gpuclusters (what nodes run the project's tools with).
    python: str


class Run(_Body):
    argv: list[str] = Field(min_length=1)
    user: str | None = None
    env: dict[str, str] | None = None
    stdin: str | None = None  # base64
    timeout_s: float = Field(default=60.0, gt=0, le=3600)


class RunResult(_Body):
    returncode: int
    stdout: str  # base64
    stderr: str  # base64


class Spawn(_Body):
    name: str
    argv: list[str] = Field(min_length=1)
    env: dict[str, str] | None = None


class Stop(_Body):
    name: str
    timeout_s: float = Field(default=10.0, gt=0, le=600)


class WriteFile(_Body):
    path: str
    data: str  # base64
    mode: int = 0o644
    owner: str | None = None


class ReadFile(_Body):
    path: str


class FileData(_Body):
    data: str | None  # base64; None: no such file


class Changed(_Body):
    changed: bool


class Running(_Body):
    running: bool


class Failure(_Body):
    """Error body: ``transient`` (retry later) or ``permanent``."""

    code: str
    message: str
