"""Input generators: the input contract (a tf.data.Dataset of NestedMap batches) and the built-
in synthetic and text inputs."""
