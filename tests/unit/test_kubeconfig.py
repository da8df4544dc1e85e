"""Kubeconfig rendering, parsing, renaming and merging (core/kubeconfig)."""

from __future__ import annotations

import base64
import copy
from typing import Any

import pytest
import yaml

from gpuclusters.core import kubeconfig

CA = b"-----BEGIN CERTIFICATE-----\nca\n-----END CERTIFICATE-----\n"
CERT = b"-----BEGIN CERTIFICATE-----\nalice\n-----END CERTIFICATE-----\n"
KEY = b"-----BEGIN PRIVATE KEY-----\nkey\n-----END PRIVATE KEY-----\n"


def _render(cluster: str = "k1", **kwargs: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "cluster_name": cluster,
        "server": f"https://{cluster}.example:6443",
        "ca_pem": CA,
        "user_name": "alice",
        "client_cert_pem": CERT,
        "client_key_pem": KEY,
    }
    values.update(kwargs)
    return kubeconfig.render(**values)


def _names(config: dict[str, Any], section: str) -> list[str]:
    return [e["name"] for e in config[section]]


def test_render_embeds_credentials_and_names_entries_after_the_cluster() -> None:
    config = _render()
    assert config["apiVersion"] == "v1" and config["kind"] == "Config"
    assert config["current-context"] == "k1"
    assert config["contexts"] == [{"name": "k1", "context": {"cluster": "k1", "user": "alice@k1"}}]
    cluster = kubeconfig.entry_data(config, "clusters", "k1")
    assert cluster["server"] == "https://k1.example:6443"
    assert base64.b64decode(cluster["certificate-authority-data"]) == CA
    user = kubeconfig.entry_data(config, "users", "alice@k1")
    assert base64.b64decode(user["client-certificate-data"]) == CERT
    assert base64.b64decode(user["client-key-data"]) == KEY


def test_render_with_context_name_and_namespace() -> None:
    config = _render(context_name="prod-k1", namespace="team-a")
    assert config["current-context"] == "prod-k1"
    assert _names(config, "clusters") == ["prod-k1"]
    assert _names(config, "users") == ["alice@prod-k1"]
    assert config["contexts"][0]["context"] == {
        "cluster": "prod-k1",
        "user": "alice@prod-k1",
        "namespace": "team-a",
    }


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"server": "http://k1:6443"}, "https://"),
        ({"cluster_name": ""}, "cluster_name"),
        ({"user_name": ""}, "user_name"),
    ],
)
def test_render_refuses_bad_input(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        _render(**kwargs)


def test_dump_and_load_round_trip_in_order() -> None:
    config = _render()
    text = kubeconfig.dump(config)
    assert text.startswith("apiVersion: v1\nkind: Config\n")
    assert kubeconfig.load(text) == config
    assert list(yaml.safe_load(text)) == list(config)


@pytest.mark.parametrize("text", ["", "   \n", "# just a comment\n"])
def test_load_of_blank_text_is_an_empty_config(text: str) -> None:
    assert kubeconfig.load(text) == kubeconfig.empty()


def test_load_fills_missing_and_null_sections() -> None:
    config = kubeconfig.load("apiVersion: v1\nkind: Config\nusers: null\ncurrent-context:\n")
    assert config["clusters"] == [] and config["users"] == [] and config["contexts"] == []
    assert config["current-context"] == ""


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("clusters: [unclosed\n", "not valid YAML"),
        ("- a\n- b\n", "expected a YAML mapping"),
        ("just a string\n", "expected a YAML mapping"),
        ("kind: Pod\n", "kind is 'Pod'"),
        ("clusters: {a: 1}\n", "'clusters' is not a list"),
        ("users:\n- user: {}\n", r"users\[0\] has no string 'name'"),
        ("current-context: [x]\n", "'current-context' is not a string"),
    ],
)
def test_load_rejects_what_is_not_a_kubeconfig(text: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        kubeconfig.load(text)


def test_rename_context_renames_its_cluster_and_user_entries() -> None:
    original = _render(namespace="ns")
    renamed = kubeconfig.rename_context(original, "lab-k1")
    assert renamed["current-context"] == "lab-k1"
    assert _names(renamed, "clusters") == ["lab-k1"]
    assert _names(renamed, "users") == ["alice@lab-k1"]
    assert renamed["contexts"] == [
        {
            "name": "lab-k1",
            "context": {"cluster": "lab-k1", "user": "alice@lab-k1", "namespace": "ns"},
        }
    ]
    assert kubeconfig.entry_data(renamed, "users", "alice@lab-k1")["client-key-data"]
    assert original == _render(namespace="ns")  # not modified
    # Same result as rendering with the context name in the first place.
    assert renamed == _render(context_name="lab-k1", namespace="ns")


def test_rename_context_needs_a_current_context() -> None:
    with pytest.raises(ValueError, match="no current context"):
        kubeconfig.rename_context(kubeconfig.empty(), "x")


def _other_file() -> dict[str, Any]:
    config = kubeconfig.merge(
        kubeconfig.load(
            "apiVersion: v1\nkind: Config\npreferences: {colors: true}\n"
            "extensions: [{name: mine, extension: {a: 1}}]\n"
        ),
        _render("k0"),
        set_current=False,
    )
    return config


def test_merge_into_empty_sets_current_context() -> None:
    merged = kubeconfig.merge(kubeconfig.empty(), _render(), set_current=False)
    assert merged["current-context"] == "k1"
    assert _names(merged, "contexts") == ["k1"]


def test_merge_adds_a_second_cluster_and_keeps_the_first() -> None:
    existing = _other_file()
    before = copy.deepcopy(existing)
    merged = kubeconfig.merge(existing, _render("k1"), set_current=False)
    assert existing == before  # inputs untouched
    for section in ("clusters", "contexts"):
        assert _names(merged, section) == ["k0", "k1"]
    assert _names(merged, "users") == ["alice@k0", "alice@k1"]
    assert merged["clusters"][0] == before["clusters"][0]
    assert merged["current-context"] == "k0"
    assert merged["preferences"] == {"colors": True}
    assert merged["extensions"] == [{"name": "mine", "extension": {"a": 1}}]


def test_merge_set_current_switches_the_context() -> None:
    merged = kubeconfig.merge(_other_file(), _render("k1"), set_current=True)
    assert merged["current-context"] == "k1"


def test_merge_replaces_entries_of_the_same_name_in_place() -> None:
    existing = kubeconfig.merge(_other_file(), _render("k1"), set_current=False)
    existing = kubeconfig.merge(existing, _render("k2"), set_current=False)
    fresh = _render("k1", server="https://new.example:6443")
    merged = kubeconfig.merge(existing, fresh, set_current=False)
    assert _names(merged, "clusters") == ["k0", "k1", "k2"]
    assert kubeconfig.entry_data(merged, "clusters", "k1")["server"] == "https://new.example:6443"
    assert merged["clusters"][2] == existing["clusters"][2]
    assert merged["current-context"] == "k0"


def test_merge_validates_both_documents() -> None:
    with pytest.raises(ValueError, match="existing kubeconfig"):
        kubeconfig.merge({"clusters": "x"}, _render(), set_current=False)
    with pytest.raises(ValueError, match="new kubeconfig"):
        kubeconfig.merge(kubeconfig.empty(), {"kind": "Pod"}, set_current=False)


def test_merged_document_dumps_to_loadable_yaml() -> None:
    merged = kubeconfig.merge(_other_file(), _render("k1"), set_current=True)
    assert kubeconfig.load(kubeconfig.dump(merged)) == merged
