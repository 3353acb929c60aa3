"""Uploading a saved artifact (bank set, selector) to a Hub model repo."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

__all__ = ["upload_saved"]


def upload_saved(save: Callable[[str | os.PathLike], object], repo_id: str, *,
                 private: bool | None, token: str | None, commit_message: str) -> str:
    """Create ``repo_id`` if needed, ``save`` into a temporary folder and upload it; returns
    the commit URL."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        save(tmp)
        info = api.upload_folder(repo_id=repo_id, folder_path=tmp, commit_message=commit_message)
    return str(getattr(info, "commit_url", info))
