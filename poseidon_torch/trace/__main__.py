"""``python -m poseidon_torch.trace``: the ``poseidon-trace`` command line."""
import sys

from .cli import main

sys.exit(main())
