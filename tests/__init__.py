# A regular package on purpose: draccus (a lerobot dependency) installs a top-level `tests` package into
# site-packages, which would otherwise shadow this directory in `from tests.conftest import ...`.
