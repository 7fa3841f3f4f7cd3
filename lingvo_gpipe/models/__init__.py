"""Models and tasks: the base model and task contract, the registry of params classes, GPipe
layer stacks and decoding."""
