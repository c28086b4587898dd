import sys

from regather.tools.cli import main

sys.exit(main())
