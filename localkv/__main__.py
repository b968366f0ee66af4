import sys

from localkv.cli import main

sys.exit(main())
