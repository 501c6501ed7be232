"""``python -m gpuq.cli``: the ``gpuq`` command."""

import sys

from gpuq.cli import main

sys.exit(main())
