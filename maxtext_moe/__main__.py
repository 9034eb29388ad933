import sys

from maxtext_moe.cli import main

sys.exit(main())
