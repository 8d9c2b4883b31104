"""`python -m nanoplug ...` is the `nanoplug` command."""
import sys

from nanoplug.cli import main

sys.exit(main())
