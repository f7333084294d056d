"""Where the tests' data lives, for test files at any depth of the tree."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository
FIXTURE_ROOT = ROOT / "tests" / "fixtures"  # copied unchanged from the reference fixtures (their README)
