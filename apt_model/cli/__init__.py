"""The ``apt-vb`` command line (also ``python -m apt_model``)."""
