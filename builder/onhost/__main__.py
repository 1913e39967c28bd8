"""``python3 -m builder.onhost COMMAND ...``: the host side from a checkout (hosts run install.pyz)."""

import sys

from .cli import main

sys.exit(main())
