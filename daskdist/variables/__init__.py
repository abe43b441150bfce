"""Variables: ordinary, mirrored and sync-on-read (``distributed.py``), sharded ones (``sharded.py``) and the
partitioners that split them (``partitioners.py``, TF's ``tf.distribute.experimental.partitioners``)."""
