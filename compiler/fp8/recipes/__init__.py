"""One recipe per file; compiler/fp8/__init__.py gathers them into ``RECIPES``."""
