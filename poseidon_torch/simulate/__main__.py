"""``python -m poseidon_torch.simulate``: the scaling simulator's command line."""
import sys

from .cli import main

sys.exit(main())
