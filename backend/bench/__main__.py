"""``python -m lightspec_backend.bench ...``: the same as ``lightspec bench ...``."""

import sys

from .command import main

sys.exit(main())
