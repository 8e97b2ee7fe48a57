import sys

from relax_hpc.cli import main

sys.exit(main())
