"""`python -m sparkrl ...`: the command line, also as torchrun starts it (`torchrun --nproc-per-node N -m sparkrl train
...`)."""

import sys

from sparkrl.commands.cli import main

sys.exit(main())
