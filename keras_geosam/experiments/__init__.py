"""What the command line (``keras_geosam.cli``) and the study
(``keras_geosam.study``) share, so each command is a thin front end:

- :mod:`.optimizers`: the registry of optimizer names (``sgd``, ``adam``,
  ``adamw`` and the two-pass family on any of those bases, ``sam@adamw``);
- :mod:`.models`: the MLP both train;
- :mod:`.data`: the probe subset sharpness is measured on (training data
  by default) and symmetric label noise;
- :mod:`.validity`: whether a run trained at all (collapsed and diverged
  runs are flagged, never measured as if they were minima);
- :mod:`.arguments`: command-line value types and CSV cells;
- :data:`DAMPING`: the relative damping of the Fisher metric both use.

Nothing here imports Keras at import time, so ``--help`` stays immediate.
"""

# Relative damping of the commands' damped S_R and Riemannian lambda_max: a
# tenth of each block's mean Fisher eigenvalue. The library's functions
# default to 1e-3 (keras_geosam.sharpness.riemannian.DEFAULT_DAMPING); the
# commands use more because undamped-ish K-FAC and Monte-Carlo estimates on
# small trained MLPs are dominated by near-null directions. Both commands
# print the value they use in --help and under every table.
DAMPING = 0.1
