"""The test suite's own guarantees: offline, no network, Triton interpreter on CPU, layout."""

from __future__ import annotations

import importlib
import os
import socket

import pytest
import torch

from tests.conftest import NetworkAccessError


def test_hub_is_offline():
    import huggingface_hub.constants

    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert huggingface_hub.constants.HF_HUB_OFFLINE


@pytest.mark.parametrize("address", [("127.0.0.1", 9), ("10.0.0.1", 443)],
                         ids=["loopback", "remote"])
def test_network_connections_fail_the_test(address):
    with pytest.raises(NetworkAccessError, match="must not use the network"):
        socket.create_connection(address, timeout=1)


def test_triton_interprets_without_a_gpu():
    if torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") != "1"
    else:
        assert os.environ["TRITON_INTERPRET"] == "1"


def test_seeded():
    first = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(first, torch.rand(3))


@pytest.mark.parametrize("package", ["hf_memory", "modeling", "hub_cards", "eval_harness"])
def test_import_packages(package):
    module = importlib.import_module(package)
    assert module.__doc__
    assert isinstance(module.__all__, list)
