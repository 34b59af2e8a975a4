import sys

from keras_geosam.study import main

sys.exit(main())
