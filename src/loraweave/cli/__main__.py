"""`python -m loraweave.cli`: the command line, as `python -m loraweave`."""

import sys

from . import main

sys.exit(main())
