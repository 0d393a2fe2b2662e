"""``python -m vime_shell.cli train ...`` (what ``torchrun -m`` launches): the ``vime`` command."""

import sys

from vime_shell.cli.main import main

sys.exit(main())
