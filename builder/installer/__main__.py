"""``python3 -m builder.installer COMMAND ...``: the host side from a checkout (hosts run install.pyz)."""

import sys

from .commands import main

sys.exit(main())
