"""Metadata lives in setup.cfg; this file only declares dashrun's optional C helper.

``optional=True``: without a C compiler the install still succeeds and the rank
stages checkpoints with torch's ``copy_`` and dash-memd receives straight into its buffers
(see dashrun/rank/staging.py and dashrun/wire/channel.py).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("dashrun.util._ntcopy", ["dashrun/util/_ntcopy.c"], optional=True)])
