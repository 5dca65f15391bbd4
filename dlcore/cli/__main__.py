import sys

from dlcore.cli import main

sys.exit(main())
