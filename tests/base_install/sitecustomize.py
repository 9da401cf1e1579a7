"""Test workers import as a base install does: without matplotlib.

The test extra installs matplotlib for the bench's plots, and Keras imports
``matplotlib.pyplot`` when it is installed (``plot_image_gallery``), whether
or not anything is drawn: 0.7 s of each worker's 4.5 s import, in some 600
worker processes a suite run. tests/conftest.py puts this directory first
on the children's PYTHONPATH, so they see what ``pip install tfdist``
without the ``bench`` extra gives; Keras then sets its plotting module to
None, as it does there. The tests that draw a plot start their processes
without it (`cluster_utils.plotting_env`).
"""

import sys

sys.modules.setdefault("matplotlib", None)  # `import matplotlib`: ImportError.
