"""python tools/reproduce.py: the same command as crossbow-reproduce (crossbow_tf.compare.reproduce).

Kept so that the commands in older docs and reports still run from a checkout, installed or not.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the checkout

from crossbow_tf.compare.reproduce import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
