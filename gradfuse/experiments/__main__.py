"""``python -m gradfuse.experiments``: the same as the ``gradfuse-experiments`` command."""
import sys

from .cli import main

sys.exit(main())
