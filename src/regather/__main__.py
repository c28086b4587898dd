"""``python -m regather``: the ``regather`` command (:func:`regather.tools.cli.main`)."""

import sys

from regather.tools.cli import main

sys.exit(main())
