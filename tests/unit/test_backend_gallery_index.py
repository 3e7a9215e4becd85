"""LocalAI's backend gallery index as ``frontend/gallery/backend_index.py`` reads it: LocalAI's
own layout (YAML anchors, a meta backend picking its CPU entry), entries that cannot be
installed left out, what each URI is, and when a replica may read its own disk for one."""

from __future__ import annotations

import pytest

from localai_tw.frontend.gallery.backend_index import (
    DOWNLOAD,
    LOCAL_FILE,
    OCI,
    concrete_for,
    local_source_allowed,
    parse_backend_index,
    source_kind,
)
from localai_tw.frontend.gallery.index import Gallery, GalleryError, yaml_load

GALLERY = Gallery("localai", "github:mudler/LocalAI/backend/index.yaml@master")

#: The shape of LocalAI's backend/index.yaml (anchors, merges, metas before concretes).
INDEX = b"""
- &llamacpp
  name: "llama-cpp"
  alias: "llama-cpp"
  license: mit
  tags: [LLM, CPU]
  capabilities:
    default: "cpu-llama-cpp"
    nvidia: "cuda12-llama-cpp"
- !!merge <<: *llamacpp
  name: "cpu-llama-cpp"
  uri: "quay.io/go-skynet/local-ai-backends:latest-cpu-llama-cpp"
  mirrors:
    - localai/localai-backends:latest-cpu-llama-cpp
  capabilities: {}
- name: "gpu-only"
  capabilities:
    nvidia: "cuda12-llama-cpp"
- name: "../escape"
  uri: "https://example.com/x.tar"
- name: "bad-digest"
  uri: "https://example.com/x.tar"
  sha256: "not-hex"
- name: "nothing"
"""


def entries():
    return parse_backend_index(yaml_load(INDEX, index=True), GALLERY)


def test_localai_index_layout_is_read_and_unusable_entries_are_left_out():
    found, skipped = entries()
    assert [e.name for e in found] == ["llama-cpp", "cpu-llama-cpp", "gpu-only"]
    assert skipped == 3
    meta, concrete, _ = found
    assert meta.is_meta and not concrete.is_meta
    assert concrete.alias == "llama-cpp" and concrete.license == "mit"
    assert concrete.mirrors == ("localai/localai-backends:latest-cpu-llama-cpp",)
    listed = meta.metadata(installed=False)
    assert listed["id"] == "localai@llama-cpp" and listed["meta"]
    assert listed["capabilities"] == {"default": "cpu-llama-cpp", "nvidia": "cuda12-llama-cpp"}


def test_a_meta_backend_picks_its_cpu_entry_or_says_why_it_cannot():
    found, _ = entries()
    assert concrete_for(found[0], found).name == "cpu-llama-cpp"
    with pytest.raises(GalleryError, match="names no backend for a CPU worker"):
        concrete_for(found[2], found)
    with pytest.raises(GalleryError, match="no backend gallery lists"):
        concrete_for(found[0], found[:1])


@pytest.mark.parametrize("uri, kind", [
    ("/opt/backends/echo", LOCAL_FILE), ("file:///srv/echo.tar.gz", LOCAL_FILE),
    ("https://example.com/echo.tar", DOWNLOAD), ("github:owner/repo/echo.tar@main", DOWNLOAD),
    ("quay.io/go-skynet/local-ai-backends:latest-cpu-llama-cpp", OCI),
    ("oci://registry.example/echo:1", OCI), ("ocifile:///tmp/image.tar", OCI),
])
def test_what_a_uri_is(uri, kind):
    assert source_kind(uri) == kind


def test_an_unknown_uri_scheme_is_refused():
    with pytest.raises(GalleryError, match="is not a directory"):
        source_kind("ftp://example.com/echo.tar")


def test_a_remote_gallery_never_makes_the_replica_read_its_own_disk():
    remote = Gallery("remote", "https://example.com/index.yaml")
    local = Gallery("mine", "file:///etc/localai/backends.yaml")
    assert not local_source_allowed(remote, allow_private=False)
    assert local_source_allowed(remote, allow_private=True)
    assert local_source_allowed(local, allow_private=False)
