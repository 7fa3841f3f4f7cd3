"""Several processes: cluster specs, tf.distribute.Server workers and their health."""
