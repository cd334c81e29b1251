"""Metadata lives in setup.cfg; this file only declares dashrun's optional C helper.

``optional=True``: without a C compiler the install still succeeds and the rank
stages checkpoints with torch's ``copy_`` (see dashrun/staging.py).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("dashrun._ntcopy", ["dashrun/_ntcopy.c"], optional=True)])
