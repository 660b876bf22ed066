import sys

from dew.cli.main import main

sys.exit(main())
