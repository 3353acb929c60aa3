"""Test-suite setup: offline Hub, Triton interpreter on CPU, seeds, markers, no network (but
loopback, where the test Hub server listens)."""

from __future__ import annotations

import os

# Before anything imports huggingface_hub / transformers: never reach the Hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import random  # noqa: E402
import socket  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

# Before any @triton.jit module is imported: interpret kernels when no GPU is visible.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

SEED = 0


class NetworkAccessError(RuntimeError):
    """Raised when a test opens a network connection."""


_real_connect = socket.socket.connect
_real_connect_ex = socket.socket.connect_ex


def _is_local_ipc(sock: socket.socket, address) -> bool:
    """A Unix socket, or TCP to this machine's loopback (the test Hub server)."""
    if getattr(socket, "AF_UNIX", None) is not None and sock.family == socket.AF_UNIX:
        return True
    host = address[0] if isinstance(address, tuple) else ""
    return host in ("localhost", "::1") or str(host).startswith("127.")


def _guarded_connect(self: socket.socket, address, *args, **kwargs):
    if _is_local_ipc(self, address):
        return _real_connect(self, address, *args, **kwargs)
    raise NetworkAccessError(f"tests must not use the network (tried to connect to {address!r})")


def _guarded_connect_ex(self: socket.socket, address, *args, **kwargs):
    if _is_local_ipc(self, address):
        return _real_connect_ex(self, address, *args, **kwargs)
    raise NetworkAccessError(f"tests must not use the network (tried to connect to {address!r})")


def pytest_configure(config: pytest.Config) -> None:
    socket.socket.connect = _guarded_connect
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:  # xdist: share the cores instead of oversubscribing them
        torch.set_num_threads(max(1, torch.get_num_threads() // workers))
    socket.socket.connect_ex = _guarded_connect_ex


def pytest_unconfigure(config: pytest.Config) -> None:
    socket.socket.connect = _real_connect
    socket.socket.connect_ex = _real_connect_ex


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device; none is visible")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)


@pytest.fixture(autouse=True)
def _restore_process_state():
    """Whatever a test changes of torch's process-wide settings is put back after it, so no
    test's outcome depends on which tests ran before it."""
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    grad = torch.is_grad_enabled()
    environ = dict(os.environ)
    yield
    torch.set_num_threads(threads)
    torch.set_default_dtype(dtype)
    torch.set_grad_enabled(grad)
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)


@pytest.fixture(scope="session")
def default_model():
    """The embedded SmolLM2-135M-Instruct, loaded once per test session (read-only use)."""
    from hf_memory import load_default_model

    return load_default_model()


@pytest.fixture
def lse_calls(monkeypatch):
    """Counts the steering's log-sum-exp path's kernel calls (the real function runs)."""
    import hf_memory.steering.attention as steering_module
    from hf_memory.steering.stock_attention import attention_with_lse

    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return attention_with_lse(*args, **kwargs)

    monkeypatch.setattr(steering_module, "attention_with_lse", counted)
    return calls


@pytest.fixture(scope="session")
def small_steering_selectors(tmp_path_factory, default_model):
    """A folder with the E+ behavioural selector of :func:`small_steering`, calibrated once per
    test run: under xdist the first worker to ask calibrates it under a file lock in the run's
    shared temporary folder and the others reuse it. Tests copy it into their own
    ``selectors_dir``, so their tasks take the saved-selector path of
    ``eval_harness.directions.behavioural_selector`` instead of calibrating again (the
    calibration itself stays covered by the trait-steering and layer-ablation runs)."""
    from filelock import FileLock

    from eval_harness.directions import direction_memory
    from tests.end_to_end import small_steering

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # this run's folder, shared by its workers
    folder = root / "small-steering-selectors"
    with FileLock(str(root / "small-steering-selectors.lock")):
        if not (folder / "E+" / "selector.json").is_file():
            model, tokenizer = default_model
            side, tokenizer.padding_side = tokenizer.padding_side, "left"
            try:
                direction_memory(model, tokenizer, "E+", small_steering(folder))
            finally:
                tokenizer.padding_side = side
    return folder
