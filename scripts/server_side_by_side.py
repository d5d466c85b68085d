"""Send one fixed list of requests to two servers (llama-server and minfer serve, say) and print where their status
codes, headers and JSON shapes differ, by group: see :mod:`minfer.testing.side_by_side`.

    python scripts/server_side_by_side.py URL_A URL_B [--key K] [--json OUT]
"""

import sys

from minfer.testing.side_by_side import main

if __name__ == "__main__":
    sys.exit(main())
