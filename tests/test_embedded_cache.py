"""The embedded models' conversion cache across processes: one conversion for processes that
start at once. Nothing here depends on the transformers release (the conversion's exactness is
in ``test_default_model.py``, which the floor environment runs)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hf_memory.models import default_model as dm
from hf_memory.models import embedded

CONVERT_SCRIPT = textwrap.dedent(
    """
    import sys
    from hf_memory.models import default_model as dm
    from hf_memory.models import embedded

    directory = dm.ensure_default_model_cached(sys.argv[1])
    print(directory.stat().st_ino, (directory / embedded.MANIFEST).stat().st_mtime_ns)
    """
)


def convert_in_subprocess(cache: Path) -> subprocess.Popen:
    """A process that converts the default model into the cache root ``cache``."""
    return subprocess.Popen([sys.executable, "-c", CONVERT_SCRIPT, str(cache)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_two_processes_converting_at_once_share_one_conversion(tmp_path):
    writers = [convert_in_subprocess(tmp_path) for _ in range(2)]
    outputs = [writer.communicate(timeout=600) for writer in writers]
    assert [w.returncode for w in writers] == [0, 0], [err for _, err in outputs]
    # The same folder and manifest: the second process waited and reused the first's result.
    assert outputs[0][0] == outputs[1][0]
    directory = dm.default_model_cache_dir(tmp_path)
    assert embedded._cache_is_complete(directory)
    assert not list(directory.parent.glob(".staging-*"))
