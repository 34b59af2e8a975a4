import sys

from keras_geosam.study.command import main

sys.exit(main())
