import os
import sys

# Tests import the shared case builders as plain modules.
sys.path.insert(0, os.path.dirname(__file__))
