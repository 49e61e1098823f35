import os
import sys

# The suite runs from a source checkout without installing it too.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
