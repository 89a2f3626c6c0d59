import sys

from minisgl.bench.cli import main

sys.exit(main())
