"""``python -m apt_model`` runs the ``apt-vb`` command line."""
import sys

from apt_model.cli.main import main

sys.exit(main())
