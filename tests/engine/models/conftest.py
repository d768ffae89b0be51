import sys
from pathlib import Path

# pytest's importlib mode puts no test folder on sys.path; this one holds the tiny DeepSeek-V4
# helpers (v4_tiny.py) its tests share.
sys.path.insert(0, str(Path(__file__).resolve().parent))
