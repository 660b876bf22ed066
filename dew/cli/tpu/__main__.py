import sys

from dew.cli.tpu import main

sys.exit(main())
