import sys

from regather.cli import main

sys.exit(main())
