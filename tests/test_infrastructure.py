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


def test_network_connections_fail_the_test():
    with pytest.raises(NetworkAccessError, match="must not use the network"):
        socket.create_connection(("10.0.0.1", 443), timeout=1)


def test_loopback_is_allowed_for_the_test_hub_server():
    with socket.socket() as server:  # nothing leaves the machine: a listener on 127.0.0.1
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        socket.create_connection(server.getsockname(), timeout=1).close()


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


def test_the_reference_attention_leaves_the_registries_as_they_were():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from tests.test_memory_inception import ConcatReference, random_bank
    from tests.tiny_models import tiny_model

    before = (set(AttentionInterface._global_mapping), set(AttentionMaskInterface._global_mapping))
    model = tiny_model("llama")
    with ConcatReference(model, [random_bank("t", "target", 3)], {0: [0]}, rho={0: 1.0},
                         gamma=1.0):
        assert ConcatReference.name in AttentionInterface._global_mapping
    assert (set(AttentionInterface._global_mapping),
            set(AttentionMaskInterface._global_mapping)) == before
