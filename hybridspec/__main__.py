"""`python -m hybridspec ...`: the same command line as the `hybridspec` console script."""

import sys

from hybridspec.cli import main

sys.exit(main())
