"""A pytest plugin for llama.cpp's server tests under bench/llamacpp_server_tests.py: their
session fixture starts every preset once so that its Hub model is downloaded before the tests
(ServerPreset.load_all); every model here is the one local GGUF the shim substitutes, so there is
nothing to download, and a preset no server can start (a reranker) must not fail the whole session."""

from __future__ import annotations


def pytest_collection_finish(session):
    import utils  # theirs: conftest.py put its folder on sys.path

    utils.ServerPreset.load_all = staticmethod(lambda: None)
