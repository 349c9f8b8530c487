"""python -m crossbow_tf.reproduce: the same command as crossbow-reproduce (crossbow_tf/compare/reproduce.py)."""
import sys

from crossbow_tf.compare.reproduce import main

if __name__ == "__main__":
    sys.exit(main())
