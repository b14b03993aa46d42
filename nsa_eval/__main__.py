import sys

from nsa_eval.cli import main

sys.exit(main())
