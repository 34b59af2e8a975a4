import sys

from keras_geosam.cli import main

sys.exit(main())
