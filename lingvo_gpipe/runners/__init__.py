"""What runs a model: the trainer binary, evaler, jobs, Estimator, Keras model and the pipeline
check."""
