"""GPipe itself: schedules as data, micro-batching, partitioning, the executor that lowers a
schedule into one traced step, and PipeliningLayer."""
