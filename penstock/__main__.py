import sys

from penstock.app.cli import main

sys.exit(main())
