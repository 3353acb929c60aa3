"""A real Hub-compatible server on loopback: olah (PyPI, MIT) in mirror mode, serving the git
repositories under ``<root>/mirrors/models/<org>/<name>`` over the Hub's HTTP API."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["HubServer"]


class HubServer:
    """``with HubServer(root) as hub:`` starts olah on 127.0.0.1; ``hub.endpoint`` is the URL
    to put in ``HF_ENDPOINT``, ``hub.git_root`` the folder ``push_folder(git_root=...)`` fills."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.git_root = self.root / "mirrors"
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> HubServer:
        self.git_root.mkdir(parents=True, exist_ok=True)
        config = self.root / "olah.toml"
        config.write_text(
            f'[basic]\nhost = "127.0.0.1"\nport = {self.port}\n'
            f'repos-path = "{self.root / "repos"}"\nmirrors-path = ["{self.git_root}"]\n'
            f'mirror-netloc = "127.0.0.1:{self.port}"\n'
            f'mirror-lfs-netloc = "127.0.0.1:{self.port}"\n'
            "[accessibility]\noffline = true\n")
        self.log = open(self.root / "olah.log", "w")  # noqa: SIM115 (closed in __exit__)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "olah.server", "--config", str(config)], cwd=self.root,
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"olah exited with {self.process.returncode}: "
                                   f"{(self.root / 'olah.log').read_text()[-500:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                if time.monotonic() > deadline:
                    self.__exit__()
                    raise RuntimeError("olah did not listen within 60 s") from None
                time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
