"""`python -m sexpgpu` is the `sexpgpu` command."""

import sys

from sexpgpu.cli import main

sys.exit(main())
