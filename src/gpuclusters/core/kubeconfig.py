"""Kubeconfig documents: render one for a cluster user, rename its context,
merge it into an existing file's document. Pure: text and dicts in, text and
dicts out; the CLI does the file I/O.

A kubeconfig (``apiVersion: v1, kind: Config``) has three named lists,
``clusters`` (API server and CA), ``users`` (credentials) and ``contexts``
(a cluster + user pair, optionally a namespace), plus ``current-context``.
What we render is self-contained (certificates embedded as base64 ``*-data``
fields, never paths, so the file can be copied anywhere) and every entry is
named after the context:

* context ``<context>`` (the cluster's name unless the caller chose one),
* cluster entry ``<context>``,
* user entry ``<user>@<context>``.

So two clusters (or the same cluster name in two projects, given distinct
context names) never overwrite each other's entries when merged into one
file, and fetching the same cluster's credentials again replaces exactly its
own three entries.

:func:`merge` follows kubectl's rules for one file: entries are matched by
name, replaced in place or appended, everything else in the file (other
entries, ``preferences``, extensions, unknown keys) is kept as is, and
``current-context`` only moves when asked to (or when the file had none).
"""

from __future__ import annotations

import base64
import copy
from typing import Any

import yaml

SECTIONS = ("clusters", "users", "contexts")
"""The named lists of a kubeconfig, each entry ``{name, <kind>: {...}}``."""

_ENTRY_KEY = {"clusters": "cluster", "users": "user", "contexts": "context"}


def empty() -> dict[str, Any]:
    """A kubeconfig with nothing in it (what an absent or empty file means)."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "preferences": {},
        "clusters": [],
        "users": [],
        "contexts": [],
        "current-context": "",
    }


def user_entry_name(user_name: str, context_name: str) -> str:
    return f"{user_name}@{context_name}"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


EXEC_API_VERSION = "client.authentication.k8s.io/v1"
# The command an exec user runs: the CLI, which the client that writes the
# kubeconfig replaces with its own path (``with_exec_command``).
EXEC_COMMAND = "gpuclusters"


def exec_user(*, project: str, cluster: str, user: str) -> dict[str, Any]:
    """A kubeconfig user that asks the CLI for a short-lived token of the
    cluster at each kubectl run (client-go's exec credential plugin). The
    CLI refuses to hand out a token of anyone but ``user``."""
    return {
        "exec": {
            "apiVersion": EXEC_API_VERSION,
            "command": EXEC_COMMAND,
            "args": ["clusters", "token", cluster, "--project", project, "--user", user],
            "env": None,
            "interactiveMode": "Never",
            "provideClusterInfo": False,
        }
    }


def render(
    *,
    cluster_name: str,
    server: str,
    ca_pem: bytes,
    user_name: str,
    client_cert_pem: bytes | None = None,
    client_key_pem: bytes | None = None,
    exec_credential: dict[str, Any] | None = None,
    context_name: str | None = None,
    namespace: str | None = None,
) -> dict[str, Any]:
    """A one-context kubeconfig for ``user_name`` on the API server at
    ``server`` (``https://host:port``), authenticating with a client
    certificate or with an exec credential plugin (``exec_user``). The
    context (named ``context_name``, default the cluster's name) is the
    current one."""
    if not cluster_name:
        raise ValueError("cluster_name must not be empty")
    if not user_name:
        raise ValueError("user_name must not be empty")
    if not server.startswith("https://"):
        raise ValueError(f"server must be an https:// URL, got {server!r}")
    if exec_credential is not None:
        user: dict[str, Any] = exec_credential
    elif client_cert_pem is not None and client_key_pem is not None:
        user = {
            "client-certificate-data": _b64(client_cert_pem),
            "client-key-data": _b64(client_key_pem),
        }
    else:
        raise ValueError("a kubeconfig user needs a client certificate or an exec credential")
    context = context_name or cluster_name
    user_entry = user_entry_name(user_name, context)
    ctx: dict[str, Any] = {"cluster": context, "user": user_entry}
    if namespace:
        ctx["namespace"] = namespace
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "preferences": {},
        "clusters": [
            {
                "name": context,
                "cluster": {"server": server, "certificate-authority-data": _b64(ca_pem)},
            }
        ],
        "users": [{"name": user_entry, "user": user}],
        "contexts": [{"name": context, "context": ctx}],
        "current-context": context,
    }


def with_exec_command(
    config: dict[str, Any], command: str, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """``config`` with every exec user running ``command`` (an absolute
    path: kubectl may run with another PATH), with ``env`` set for it."""
    out = dict(config)
    users = []
    for entry in config.get("users") or []:
        user = dict(entry.get("user") or {})
        if isinstance(user.get("exec"), dict) and user["exec"].get("command") == EXEC_COMMAND:
            exe = dict(user["exec"])
            exe["command"] = command
            exe["env"] = [{"name": k, "value": v} for k, v in sorted((env or {}).items())] or None
            user["exec"] = exe
        users.append({**entry, "user": user})
    out["users"] = users
    return out


def dump(config: dict[str, Any]) -> str:
    """YAML text, keys in the document's order."""
    return yaml.safe_dump(config, sort_keys=False, default_flow_style=False)


def _normalized(doc: object, *, what: str) -> dict[str, Any]:
    """Check the shape we rely on and fill in missing sections (a file
    written by hand may lack some; kubectl writes ``null`` for empty ones)."""
    if not isinstance(doc, dict):
        raise ValueError(f"{what} is not a kubeconfig: expected a YAML mapping")
    kind = doc.get("kind")
    if kind is not None and kind != "Config":
        raise ValueError(f"{what} is not a kubeconfig: kind is {kind!r}, not 'Config'")
    out: dict[str, Any] = dict(doc)
    out.setdefault("apiVersion", "v1")
    out.setdefault("kind", "Config")
    for section in SECTIONS:
        entries = out.get(section)
        if entries is None:
            out[section] = []
            continue
        if not isinstance(entries, list):
            raise ValueError(f"{what} is not a kubeconfig: {section!r} is not a list")
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                raise ValueError(f"{what} is not a kubeconfig: {section}[{i}] has no string 'name'")
    current = out.get("current-context")
    if current is None:
        out["current-context"] = ""
    elif not isinstance(current, str):
        raise ValueError(f"{what} is not a kubeconfig: 'current-context' is not a string")
    return out


def load(text: str) -> dict[str, Any]:
    """Parse kubeconfig YAML; empty or blank text is an empty kubeconfig.
    Raises ``ValueError`` saying what is wrong."""
    if not text.strip():
        return empty()
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"not valid YAML: {exc}") from exc
    if doc is None:  # only comments
        return empty()
    return _normalized(doc, what="the document")


def _find(config: dict[str, Any], section: str, name: str) -> dict[str, Any] | None:
    for entry in config[section]:
        if entry["name"] == name:
            found: dict[str, Any] = entry
            return found
    return None


def rename_context(config: dict[str, Any], context_name: str) -> dict[str, Any]:
    """A copy of a one-cluster kubeconfig (as :func:`render` makes) whose
    current context is called ``context_name``, with its cluster entry and
    user entry renamed to match (``<context>`` and ``<user>@<context>``,
    where ``<user>`` is the part of the old user entry name before ``@``).
    Entries other than the current context's are left alone."""
    if not context_name:
        raise ValueError("context_name must not be empty")
    out = _normalized(copy.deepcopy(config), what="the document")
    old = out["current-context"]
    ctx_entry = _find(out, "contexts", old) if old else None
    if ctx_entry is None or not isinstance(ctx_entry.get("context"), dict):
        raise ValueError(f"the kubeconfig has no current context to rename (got {old!r})")
    ctx = ctx_entry["context"]
    cluster_entry = _find(out, "clusters", str(ctx.get("cluster", "")))
    user_entry = _find(out, "users", str(ctx.get("user", "")))
    if cluster_entry is not None:
        cluster_entry["name"] = ctx["cluster"] = context_name
    if user_entry is not None:
        user = str(user_entry["name"]).rpartition("@")[0] or str(user_entry["name"])
        user_entry["name"] = ctx["user"] = user_entry_name(user, context_name)
    ctx_entry["name"] = out["current-context"] = context_name
    return out


def merge(existing: dict[str, Any], new: dict[str, Any], *, set_current: bool) -> dict[str, Any]:
    """``existing`` with ``new``'s clusters, users and contexts added, or
    replacing entries of the same name in place; other entries and keys are
    kept in their order. ``current-context`` becomes ``new``'s only when
    ``set_current`` or when ``existing`` had none. Neither input is changed."""
    out = _normalized(copy.deepcopy(existing), what="the existing kubeconfig")
    incoming = _normalized(copy.deepcopy(new), what="the new kubeconfig")
    for section in SECTIONS:
        entries: list[dict[str, Any]] = out[section]
        index = {entry["name"]: i for i, entry in enumerate(entries)}
        for entry in incoming[section]:
            if entry["name"] in index:
                entries[index[entry["name"]]] = entry
            else:
                index[entry["name"]] = len(entries)
                entries.append(entry)
    if incoming["current-context"] and (set_current or not out["current-context"]):
        out["current-context"] = incoming["current-context"]
    return out


def entry_data(config: dict[str, Any], section: str, name: str) -> dict[str, Any]:
    """The inner mapping of a named entry (``{"server": ..., ...}`` for a
    cluster); ``KeyError`` if there is none. For callers and tests that read
    a rendered config back."""
    entry = _find(_normalized(config, what="the document"), section, name)
    if entry is None:
        raise KeyError(f"no {section} entry named {name!r}")
    inner = entry.get(_ENTRY_KEY[section])
    if not isinstance(inner, dict):
        raise KeyError(f"{section} entry {name!r} has no {_ENTRY_KEY[section]!r} mapping")
    return inner
