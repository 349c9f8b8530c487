"""python -m crossbow_tf.compare: the same command as crossbow-compare."""
import sys

from crossbow_tf.compare.cli import main

sys.exit(main())
