"""The probe's optional native kernel (probes/_fastats.c): everything else is in pyproject.toml.

``optional=True``: without a C compiler the install still succeeds and the probe keeps its torch path.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("probes._fastats", ["probes/_fastats.c"], optional=True,
                             extra_compile_args=["-O3", "-fopenmp-simd"])])
