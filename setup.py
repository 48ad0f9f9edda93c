# Users of the original Search-R1 expect a setup.py at the top level (`python setup.py ...`, old
# pip versions, `pip install -e .` scripts). Everything, metadata and packages included, lives in
# pyproject.toml; this file only hands over to it, so the two can never disagree.
from setuptools import setup

setup()
