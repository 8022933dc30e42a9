"""Infrastructure: object storage, cluster backends, the scheduler and the simulator. Never imports the trainer."""
