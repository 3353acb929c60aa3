"""``python -m hf_memory_cli``: the ``hf-memory`` command (what ``accelerate launch -m`` runs)."""

import sys

from .main import main

sys.exit(main())
